"""`grpo-stream plan`, the part that runs in a child process on fake CPU devices: build the run's model as abstract
arrays (shapes, dtypes and shardings, nothing allocated), compile the trainer's update step on the trainer mesh and
the sampler engine's programs on one sampler's mesh, and report per device what XLA's `memory_analysis()` of each
compiled program says, split into the categories a user can act on.

The parent (plan_command.py) starts this module with
XLA_FLAGS=--xla_force_host_platform_device_count=N, so the programs are partitioned exactly as on N real devices;
only the backend differs (CPU, not TPU or GPU), which changes fusion and buffer reuse: the figures are an estimate.
Input: the resolved config as JSON on stdin. Output: one JSON document on stdout; progress on stderr.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.engine import continuous
from grpo_stream.common.engine.slot_programs import MIN_SLOTS, MIN_WINDOW, pow2_at_least
from grpo_stream.common.registry.engines import engine_spec
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.lora import abstract_lora, merge_named
from grpo_stream.common.model.policy import (PolicyModel, build_from_architecture, row_logprobs, segment_mask,
                                             tiny_architecture)
from grpo_stream.common.model.sharding import make_mesh, param_shardings
from grpo_stream.common.registry.transports import transport_spec
from grpo_stream.plan.evaluation import evaluation_bytes, evaluation_report, evaluation_rows, shard_bytes
from grpo_stream.plan.resident import compile_growth, runtime_bytes
from grpo_stream.trainer_service.learning.packing import PackedPasses, packing_layout
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater, donates_updates


def progress(message: str) -> None:
    print(f"plan: {message}", file=sys.stderr, flush=True)


def architecture(cfg: RunConfig) -> Architecture:
    """The model's shape: the tiny model's, the checkpoint's config.json, or a known checkpoint's by name."""
    if cfg.model.kind == "tiny":
        return tiny_architecture(cfg.model, cfg.model.tiny.vocab_size)
    return checkpoint_architecture(cfg.model.path, "model.path")


def cached_config(hub_id: str):
    """The config.json of hub id `hub_id` in the local Hugging Face cache (no download), or None."""
    if hub_id.count("/") != 1 or hub_id.startswith((".", "/")):
        return None
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415 - deferred: a hub id only

    try:
        found = try_to_load_from_cache(repo_id=hub_id, filename="config.json")
    except Exception:  # noqa: BLE001 - a malformed id: not in the cache
        return None
    return pathlib.Path(found) if isinstance(found, str) else None


def checkpoint_architecture(path: str, field: str) -> Architecture:
    """The shape of the checkpoint at `path` (the setting `field`): its config.json, or a known one's by name."""
    from grpo_stream.common.model.hf_checkpoint import read_architecture  # noqa: PLC0415
    from grpo_stream.common.model.known_architectures import KNOWN_CONFIGS, known_architecture  # noqa: PLC0415

    if (pathlib.Path(path) / "config.json").is_file():
        return read_architecture(path)
    arch = known_architecture(path)
    cached = cached_config(path) if arch is None else None
    if cached is not None:  # a hub id the processes would find in the local Hugging Face cache: its config
        return read_architecture(cached.parent)
    if arch is None:
        raise ValueError(f"{field}={path}: no config.json there and not a checkpoint plan knows by name "
                         f"({', '.join(KNOWN_CONFIGS)}); point {field} at a directory holding the model's "
                         "config.json (the weights are not read)")
    return arch


def analysed(compiled) -> dict[str, int]:
    """XLA's memory analysis of one compiled program, per device; `peak` = arguments + outputs - aliased + temp."""
    m = compiled.memory_analysis()
    out = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "aliased": int(m.alias_size_in_bytes), "temporaries": int(m.temp_size_in_bytes),
           "code": int(m.generated_code_size_in_bytes)}
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


def abstract_model(arch: Architecture, dtype: Any, mesh) -> PolicyModel:
    model = build_from_architecture(arch, None, dtype)
    shardings = param_shardings(model.params, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), model.params, shardings)
    return dataclasses.replace(model, params=params)


def model_dtype(cfg: RunConfig, role: str = "trainer"):
    dtype = cfg.model.dtype if role == "trainer" else cfg.sampler_dtype()
    return jnp.bfloat16 if dtype == "bfloat16" else jnp.float32


def trainer_programs(cfg: RunConfig, arch: Architecture) -> dict:
    """Compile the update step (and the logprob pass the old/reference logprobs need) on the trainer mesh: a
    minibatch's packed passes' gradient accumulation (one pass's activations at a time, in the pass's token budget;
    one sequence a row with trainer.packing=false) and the optimizer update."""
    t, gen, algo = cfg.trainer, cfg.generation, cfg.algo
    mesh = make_mesh(t.mesh.fsdp, t.mesh.tp, jax.devices(), "trainer.mesh")
    model = abstract_model(arch, model_dtype(cfg), mesh)
    donate = donates_updates(transport_spec(cfg.weights.transport).in_process)
    trained, trainable, lora = model.with_remat(t.remat), None, None
    if cfg.model.lora is not None:  # the adapted model, training the adapters only, as the trainer builds it
        lora = abstract_lora(trained, cfg.model.lora, cfg.run.seed)
        trained, trainable = lora.adapted, lora.trainable()
    layout = packing_layout(cfg, t.mesh.fsdp, arch)
    teacher = abstract_teacher(cfg, mesh)
    updater = PolicyUpdater(trained, trained.params, algo, t.learning_rate, t.max_grad_norm, gen.temperature, 0,
                            layout, mesh, t.optimizer, t.steps, donate=donate, trainable=trainable, teacher=teacher,
                            distill=cfg.distill if teacher is not None else None)
    needs_old = algo.num_iterations > 1 or algo.minibatches > 1
    started = time.time()
    shape = (f"passes of {layout.rows} packed rows of {layout.row_tokens} tokens" if layout.segments_per_row > 1
             else f"passes of {layout.rows} sequences of {layout.row_tokens} tokens, one a row")
    progress(f"trainer: compiling the update step ({model.num_params() / 1e9:.3g}B parameters, mesh fsdp "
             f"{t.mesh.fsdp} x tp {t.mesh.tp}, {shape})")
    step, logprobs, batch_bytes = step_programs(cfg, updater, mesh, needs_old)
    progress(f"trainer: update step compiled in {time.time() - started:.0f} s")
    params, opt_state = shard_bytes(updater.params), shard_bytes(updater.opt_state)
    train_bytes = shard_bytes(updater.split(updater.params)[0])  # with LoRA the adapters; else all parameters
    reference = train_bytes if algo.beta > 0 else 0  # with LoRA the reference shares the frozen base
    programs = {"update_step": step}
    if logprobs is not None:
        programs["logprobs"] = logprobs
    distill = teacher_report(cfg, updater) if teacher is not None else None
    if distill is not None:
        programs["teacher_logprobs"] = distill.pop("program")
    gradients = min(train_bytes * (2 if updater.master else 1), step["temporaries"])  # float32 with a master copy
    teacher_bytes = distill["parameters_bytes"] if distill is not None else 0
    # weights.publish_copy: a donating update leaves a copy of the trained parameters for the publication to read
    publication = train_bytes if donate and cfg.weights.publish_copy else 0
    per_device = {"parameters": params, "optimizer_state": opt_state, "reference_parameters": reference,
                  "teacher_parameters": teacher_bytes, "publication_copy": publication, "batch": batch_bytes,
                  "gradients": gradients,
                  "activations_and_temporaries": step["temporaries"] - gradients,
                  "updated_state": step["outputs"] - step["aliased"]}
    # beyond what stays resident: the step's batch, temporaries and not-in-place outputs, or the logprob pass's
    step_extra = per_device["batch"] + step["temporaries"] + per_device["updated_state"]
    logprob_extra = (programs["logprobs"]["peak"] - params) if "logprobs" in programs else 0
    # the teacher's forward runs before the step's updates: its batch, activations and output beside the resident
    teacher_extra = programs["teacher_logprobs"]["peak"] - teacher_bytes if distill is not None else 0
    extras = {"update_step": step_extra, "logprobs": logprob_extra, "teacher_logprobs": teacher_extra}
    # the held-out evaluation's engine on these devices: beside the steps during RL, else between them
    evaluation = evaluation_report(cfg, model)
    per_device["evaluation"] = evaluation_bytes(evaluation)
    if evaluation is not None and not evaluation["during_rl"]:
        extras["evaluation"] = per_device["evaluation"]
    per_device["total"] = (params + opt_state + reference + teacher_bytes + publication + max(extras.values())
                           + (per_device["evaluation"] if evaluation is not None and evaluation["during_rl"] else 0))
    packing = {"rows": layout.rows, "row_tokens": layout.row_tokens, "tokens_per_pass": layout.rows * layout.row_tokens,
               "segments_per_row": layout.segments_per_row}
    out = {"devices": t.mesh.fsdp * t.mesh.tp, "mesh": {"fsdp": t.mesh.fsdp, "tp": t.mesh.tp},
           "parameters": model.num_params(), "trained_parameters": lora.adapter_count() if trainable else
           model.num_params(), "per_device_bytes": per_device, "programs": programs, "packing": packing,
           "peak_program": max(extras, key=extras.get)}
    if distill is not None:
        out["teacher"] = distill
    if evaluation is not None:
        out["evaluation"] = evaluation
    return out


def abstract_teacher(cfg: RunConfig, mesh):
    """The distillation teacher as abstract arrays on the trainer mesh (None without distill.teacher): its shape
    from its config.json (or a known checkpoint's), in distill.dtype."""
    if not cfg.distill.enabled:
        return None
    from grpo_stream.trainer_service.learning.distill import Teacher  # noqa: PLC0415

    dtype = cfg.distill.dtype if cfg.distill.dtype != "model" else cfg.model.dtype
    arch = checkpoint_architecture(cfg.distill.teacher, "distill.teacher")
    model = abstract_model(arch, jnp.bfloat16 if dtype == "bfloat16" else jnp.float32, mesh)
    return Teacher(model, cfg.distill.teacher)


def teacher_report(cfg: RunConfig, updater: PolicyUpdater) -> dict:
    """The teacher's share of a trainer step: its parameters' bytes per device, its forward program (compiled over
    a minibatch's stacked passes, as the update runs it) and the FLOPs of its forwards per step: XLA's count for one
    pass, times the passes a minibatch holds at most, times the minibatches (num_iterations reuse them)."""
    layout, packed = updater.layout, updater.programs
    m, t = layout.rows, layout.row_tokens
    teacher = updater.teacher.model
    one_row = NamedSharding(packed.sharding.mesh, PartitionSpec(*packed.sharding.spec[1:]))  # a pass's [m, T]
    row = lambda dtype: jax.ShapeDtypeStruct((m, t), dtype, sharding=one_row)  # noqa: E731
    one_pass = jax.jit(lambda params, tokens, positions, segments: row_logprobs(
        teacher, params, tokens, positions, segment_mask(segments), updater.temperature, updater.pad_id))
    flops = one_pass.lower(teacher.params, row(jnp.int32), row(jnp.int32), row(jnp.int32)).compile().cost_analysis()
    flops = float((flops[0] if isinstance(flops, list) else flops).get("flops", 0.0))
    passes, _, count = stacked_passes(updater)
    program = analysed(packed._teacher_logprobs.lower(teacher.params, passes, count).compile())
    per_step = flops * layout.passes * cfg.algo.minibatches
    return {"parameters": teacher.num_params(), "architecture": dataclasses.asdict(teacher.arch),
            "parameters_bytes": shard_bytes(teacher.params), "flops_per_pass": flops,
            "forward_flops_per_step": per_step, "program": program}


def stacked_passes(updater: PolicyUpdater) -> tuple[PackedPasses, Any, Any]:
    """(a minibatch's stacked passes, per-token row values [K, m, T - 1], passes in use) as abstract arrays placed as
    the update places them."""
    layout, packed = updater.layout, updater.programs
    k, m, t, s = layout.passes, layout.rows, layout.row_tokens, layout.segments_per_row
    arr = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=packed.sharding)  # noqa: E731
    passes = PackedPasses(tokens=arr((k, m, t), jnp.int32), positions=arr((k, m, t), jnp.int32),
                          segments=arr((k, m, t), jnp.int32), loss_mask=arr((k, m, t - 1), jnp.float32),
                          behaviour=arr((k, m, t - 1), jnp.float32), starts=arr((k, m, s), jnp.int32),
                          lengths=arr((k, m, s), jnp.int32), advantages=arr((k, m, s), jnp.float32),
                          fresh=arr((k, m, s), jnp.float32))
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(packed.sharding.mesh, PartitionSpec()))
    return passes, arr((k, m, t - 1), jnp.float32), count


def step_programs(cfg: RunConfig, updater: PolicyUpdater, mesh, needs_old: bool):
    """(update step, logprob pass or None, batch bytes per device): a minibatch's update over its stacked passes
    (one pass's activations at a time, in the pass's token budget) and the logprob pass."""
    packed, algo = updater.programs, cfg.algo
    passes, rows, count = stacked_passes(updater)
    replicated = NamedSharding(mesh, PartitionSpec())
    norm = (jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated),) * 2
    step = analysed(packed._step.lower(*updater.split(updater.params), updater.opt_state, passes, count,
                                       rows if needs_old else None, rows if algo.beta > 0 else None,
                                       rows if updater.teacher is not None else None, norm).compile())
    logprobs = (analysed(packed._logprobs.lower(updater.params, passes, count).compile())
                if needs_old or algo.beta > 0 else None)
    return step, logprobs, step["arguments"] - shard_bytes(updater.params) - shard_bytes(updater.opt_state)


def sampler_programs(cfg: RunConfig, arch: Architecture) -> dict:
    """Compile the JAX engine's weight re-layout, prompt prefill and decode chunk at the most rows a sampler decodes
    at once (its rows in flight, at most generation.decode_slots; the slot ladder's size holding them) and the most
    distinct prompts it admits at once (a group's rows share one), on one sampler's mesh."""
    gen, s = cfg.generation, cfg.sampler
    mesh = make_mesh(1, s.mesh.tp, jax.devices(), "sampler.mesh.tp")
    model = abstract_model(arch, model_dtype(cfg, "sampler"), mesh)
    engine = continuous.ContinuousEngine(model, 0, 1, **continuous.engine_settings(cfg))
    rows = min(engine.slots, cfg.rows_in_flight())
    slots = engine.table.size_for(rows)
    window = engine.cache_len
    replicated = NamedSharding(mesh, PartitionSpec())
    progress(f"sampler: compiling re-layout, prefill and decode ({slots} slots, {window}-token cache, tp {s.mesh.tp})")
    started = time.time()
    relayout_compiled = engine.device.relayout.lower(model.params).compile()
    weights = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh),
                           jax.eval_shape(engine.device.relayout, model.params), relayout_compiled.output_shardings)
    engine.device.use_mesh(weights)  # the slot state on the sampler's mesh, as a serve lays it out
    compiled, states = compiled_decode(engine, weights, slots, window, replicated, long_group_slots(engine, slots))
    decode = analysed(compiled)
    # a run compiles the decode program once per slot count and window it decodes at: what one more costs
    decode_growth = (other_decodes(engine, weights, slots, window, replicated) if cfg.hardware.any_on_cpu()
                     else None)
    prompts = pow2_at_least(max(1, rows // gen.num_generations))
    width = min(engine.cache_len, pow2_at_least(gen.max_prompt_tokens, 16))
    prefill = analysed(engine.device.prefill.lower(
        weights, jax.ShapeDtypeStruct((prompts, width), jnp.int32, sharding=replicated),
        jax.ShapeDtypeStruct((prompts,), jnp.int32, sharding=replicated)).compile())
    relayout = analysed(relayout_compiled)
    programs = {"relayout": relayout, "prefill": prefill, "decode_chunk": decode}
    regroup = regroup_program(engine, slots, window, replicated)
    if regroup is not None:
        programs["regroup"] = regroup
    params, relaid, kv = shard_bytes(model.params), shard_bytes(weights), shard_bytes(states)
    extra = {"decode_chunk": decode["outputs"] - decode["aliased"] + decode["temporaries"],
             "prefill": prefill["peak"] - relaid,
             "relayout": relayout["outputs"] + relayout["temporaries"] - relaid}  # the old copy is freed first
    if regroup is not None:  # the smaller group, beside the full one it moves into, and the move's temporaries
        extra["regroup"] = regroup["peak"] - shard_bytes(states[0])
    base = 0
    if cfg.model.lora is not None:  # the frozen base stays beside the merged weights; each version is merged into it
        base = params
        programs["lora_merge"] = lora_merge_program(cfg, model)
        merge = programs["lora_merge"]
        # the version's adapters and the merge's temporaries (its output is the version arriving: the fetch buffer)
        extra["lora_merge"] = merge["arguments"] - params + merge["temporaries"]
    progress(f"sampler: compiled in {time.time() - started:.0f} s")
    # fetch_buffer: the next version arrives beside the installed one and its layout, which the engine (its own
    # thread) holds until it takes the new one, whatever weights.background_fetch says (false: the feeder fetches)
    per_device = {"parameters": params, "fetch_buffer": params, "lora_base": base, "decode_weights": relaid,
                  "kv_cache": kv, "temporaries": max(extra.values())}
    per_device["total"] = 2 * params + base + relaid + kv + per_device["temporaries"]
    return {"devices": s.mesh.tp, "mesh": {"tp": s.mesh.tp}, "slots": slots, "cache_tokens": window,
            "long_slots": states[1].length.shape[0] if len(states) > 1 else 0,
            "per_device_bytes": per_device, "programs": programs,
            "peak_program": max(extra, key=extra.get), "decode_compile": decode_growth,
            "decode_variants": {"sampler": decode_variants(engine, rows),
                                "evaluation": decode_variants(engine, max(1, evaluation_rows(cfg)))}}


def slot_state(engine: continuous.ContinuousEngine, slots: int, window: int, replicated):
    """A group of `slots` free slots with a `window`-token cache as abstract arrays, laid out as the engine's `empty`
    makes it on the sampler's mesh (the caches' KV heads split over tp where tp divides them, slot_programs.py);
    replicated off a mesh of several devices."""
    shapes = jax.eval_shape(functools.partial(engine.device.empty, size=slots, window=window))
    if engine.device.mesh is None:
        return jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=replicated), shapes)
    placed = engine.device.empty.lower(size=slots, window=window).compile().output_shardings
    return jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh), shapes, placed)


def compiled_decode(engine: continuous.ContinuousEngine, weights, slots: int, window: int, replicated,
                    long: int = 0):
    """(the decode program compiled for `slots` slots and `long` of a second group at a `window`-token cache, their
    slot states as abstract arrays laid out as the engine makes them)."""
    states = tuple(slot_state(engine, n, window, replicated) for n in (slots, long) if n)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    return engine.device.decode.lower(weights, states, scalar, windows=(window,) * len(states)).compile(), states


def long_group_slots(engine: continuous.ContinuousEngine, slots: int) -> int:
    """Slots of the long group (decode_length_groups=2; else 0) beside a main group of `slots`, both at the whole
    window at worst: the engine bounds the two only by decode_slots whole sequences (room with fewer rows)."""
    if engine.table.length_groups < 2:
        return 0
    fits = [n for n in engine.table.ladder if MIN_SLOTS <= n <= min(slots, engine.slots - slots)]
    return fits[-1] if fits else 0


def regroup_program(engine: continuous.ContinuousEngine, slots: int, window: int, replicated) -> dict | None:
    """The engine's move of a slot group's live sequences into a larger group (slot_table.py, _regroup), compiled
    from the ladder's next smaller size to `slots` at the whole window: both groups are on the device until the move
    ends (1.75x the KV cache from 48 to 64 slots). None: no smaller size."""
    smaller = [n for n in engine.table.ladder if n < slots]
    if not smaller:
        return None
    index = jax.ShapeDtypeStruct((smaller[-1],), jnp.int32, sharding=replicated)
    return analysed(engine.device.move.lower(slot_state(engine, smaller[-1], window, replicated),
                                             slot_state(engine, slots, window, replicated), index, index).compile())


def other_decodes(engine: continuous.ContinuousEngine, weights, slots: int, window: int,
                  replicated) -> dict[str, int] | None:
    """{peak, retained} of compiling one more decode program, the mean over up to two other sizes a run compiles
    (the next smaller slot counts of the ladder, or the smallest window): what each leaves varies by tens of MB;
    `compiled`: how many (the sampler's compile, measured around this one, holds them)."""
    sizes = [(n, window) for n in engine.table.ladder if n < slots][-2:]
    sizes += [(slots, MIN_WINDOW)] if window > MIN_WINDOW and len(sizes) < 2 else []
    if not sizes:
        return {"peak": 0, "retained": 0, "compiled": 0}

    def compile_them() -> None:
        for size, width in sizes:
            compiled_decode(engine, weights, size, width, replicated)

    growth = compile_growth(compile_them, nested=True)[1]
    return {**{k: v // len(sizes) for k, v in growth.items()}, "compiled": len(sizes)} if growth is not None else None


def decode_variants(engine: continuous.ContinuousEngine, rows: int) -> int:
    """Decode programs an engine decoding up to `rows` rows compiles: one per slot count of its ladder up to the one
    holding them, per cache window (multiples of MIN_WINDOW up to its cache)."""
    sizes = [n for n in engine.table.ladder if n <= engine.table.size_for(rows)]
    return len(sizes) * (engine.cache_len // MIN_WINDOW)


def lora_merge_program(cfg: RunConfig, model: PolicyModel) -> dict[str, int]:
    """A sampler's merge of one adapters-only version (replicated adapters) into the frozen base, compiled as the
    sampler compiles it: outputs placed like the installed weights."""
    lora = abstract_lora(model, cfg.model.lora, cfg.run.seed)
    _, adapters = lora.split_named(lora.adapted.params)
    mesh = next(x.sharding.mesh for x in jax.tree.leaves(model.params))
    replicated = NamedSharding(mesh, PartitionSpec())
    adapters = {n: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated) for n, x in adapters.items()}
    base = model.named_arrays()
    merge = jax.jit(lambda b, a: merge_named(b, a, lora.weights, lora.scale),
                    out_shardings={name: x.sharding for name, x in base.items()})
    return analysed(merge.lower(base, adapters).compile())


def main() -> int:
    cfg = RunConfig.model_validate(json.loads(sys.stdin.read()))
    arch = architecture(cfg)
    on_cpu = cfg.hardware.any_on_cpu()
    # a plan for CPU processes measures this process too: the runtime before any weights, and each role's compiles
    host: dict[str, Any] = {"runtime": runtime_bytes(cfg)} if on_cpu else {}
    out: dict[str, Any] = {"architecture": dataclasses.asdict(arch), "backend": jax.default_backend(),
                           "jax": jax.__version__}
    if engine_spec(cfg.sampler.engine).jax_mesh:  # the JAX engine; vLLM sizes its own memory
        out["sampler"], host["sampler_compile"] = compile_growth(lambda: sampler_programs(cfg, arch))
    out["trainer"], host["trainer_compile"] = compile_growth(lambda: trainer_programs(cfg, arch))
    if on_cpu:
        out["host_measured"] = host
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
