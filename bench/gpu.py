"""The accelerator checks of issues 21 and 22, on whatever device JAX (and PyTorch) see:

    python -m grpo_stream.bench.gpu trainer [--quick] [--out F] [--plan-json P] [--deadline-s S] [--config C]
                                            [--set KEY=VALUE ...]
    python -m grpo_stream.bench.gpu sampler [--quick] [--out F] [--deadline-s S]
    python -m grpo_stream.bench.gpu engine --config C [--set KEY=VALUE ...] [--rows N ...] [--out F]
                                           [--deadline-s S]

`trainer`: one update step of a Llama-3.2-1B-shaped model (random init) under the GPU preset's trainer settings
(configs/qwen2.5_1.5b_gsm8k_gpu.yaml: bf16 parameters with float32 Adam state, full remat, micro-batches of 2,
32 sequences of 768 tokens, a KL reference): XLA's memory analysis of the update step compiled for this backend
(the same code `grpo-stream plan` runs on CPU), the device's measured peak memory, the step's time and its model
FLOPs utilisation (MFU), the FLOPs of exactly the passes the update runs (`passes_per_step`: the training passes,
and the forward passes of the old logprobs, the reference model and a teacher where it runs them). With `--plan-json` (the JSON of `grpo-stream plan` for the same config, run on CPU) the
CPU estimate sits beside the measurement.

`engine --config C [--set KEY=VALUE ...]`: the continuous engine a sampler of that run builds (its model, dtype,
slots, chunk steps, prompt and completion budgets, temperature), alone on this device and kept full: the run's first
dataset prompts, generation.num_generations rows each, as many whole groups as its sampler keeps in flight, each with
a budget of generation.max_new_tokens (its stop tokens kept, as the sampler's: a random-init model rarely samples one;
the rate counts the tokens made), one untimed run then medians of 3; `--rows N` (repeatable) times other loads too,
such as the rows a run's admission lets its sampler hold. `scripts/gpu-check.sh` sets the sampler's own tokens/s in
a run of the same config beside it: how much of its engine the rollout stream keeps busy.

`sampler`: `bench sampler`'s request sets (64 prompts x 8 completions, 32-128 prompt tokens, longtail and fixed
budgets up to 512 new tokens, EOS disabled) on the same model shape in bfloat16: the continuous engine (512 slots:
the whole set at once, as the static batchers take it), the static engine it replaced, and Hugging Face `generate` on PyTorch on the same device with
the same weights. vLLM is not timed here (no GPU build of it travels to the measuring machine).

Each stage's result is written to `--out` as soon as it exists, so a run stopped at its deadline keeps what it
measured; stages that would start past `--deadline-s` are reported as skipped. `--quick`: tiny shapes, for tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

PRESET = pathlib.Path("configs/qwen2.5_1.5b_gsm8k_gpu.yaml")  # from the repository's root, as the README's commands
SHAPE = "llama-3.2-1b"
# dense bf16 peak FLOP/s by the vendors' datasheets (SXM parts), for MFU; keys match jax's device_kind
PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
QUICK_TRAINER = ["model.kind=tiny", "model.tiny.num_layers=2", "model.tiny.embed_dim=64", "model.tiny.hidden_dim=128",
                 "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.head_dim=32", "model.dtype=float32",
                 "generation.max_prompt_tokens=16", "generation.max_new_tokens=16", "trainer.groups_per_step=2",
                 "generation.num_generations=2"]
QUICK_SAMPLER = {"prompts": 2, "generations": 4, "prompt_low": 8, "prompt_high": 16, "max_new_tokens": 16,
                 "repeats": 1, "slots": 8, "chunk_steps": 8}
FULL_SAMPLER = {"prompts": 64, "generations": 8, "prompt_low": 32, "prompt_high": 128, "max_new_tokens": 512,
                "repeats": 3, "slots": 512, "chunk_steps": 16}


def progress(message: str) -> None:
    print(f"bench gpu: {message}", file=sys.stderr, flush=True)


def device_facts() -> dict:
    dev = jax.devices()[0]
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind, "devices": jax.device_count(),
            "jax": jax.__version__}


def peak_flops(kind: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in kind.upper()), None)


def memory_stats() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def model_flops_per_token(arch, context: int, backward: bool) -> float:
    """Model FLOPs per token (PaLM's count: matmul parameters x 2 forward, x 6 with the backward pass, plus
    attention's 4 x layers x heads x head_dim x context forward; the embedding lookup is free, a tied embedding's
    head matmul is not; remat's recomputation is not model work)."""
    embed = arch.vocab_size * arch.embed_dim
    attn = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    layer = arch.embed_dim * (2 * attn + 2 * kv) + 3 * arch.embed_dim * arch.hidden_dim
    matmul = arch.num_layers * layer + embed  # the head (tied or not); the input embedding costs nothing
    per_token = 2 * matmul + 4 * arch.num_layers * attn * context
    return 3 * per_token if backward else per_token


def update_passes(updater) -> dict[str, int]:
    """The passes over the whole batch one `PolicyUpdater.update` runs (trainer_service/learning/rl_update.py):
    `train` forward-and-backward passes (num_iterations; the minibatches split one pass), and forward-only passes
    for the old logprobs (when minibatches or num_iterations > 1), the reference model (algo.beta > 0) and the
    distillation teacher (when the updater has one)."""
    algo = updater.algo
    return {"train": algo.num_iterations, "old_logprobs": int(algo.num_iterations > 1 or algo.minibatches > 1),
            "reference": int(updater.ref_params is not None), "teacher": int(updater.teacher is not None)}


def update_flops(arch, tokens: int, context: int, passes: dict[str, int], teacher_arch=None) -> float:
    """Model FLOPs of one update over `tokens` tokens of `context`: exactly the `passes` it runs (update_passes),
    the teacher's forward at the teacher's own shape."""
    forward = passes["old_logprobs"] + passes["reference"]
    flops = tokens * (passes["train"] * model_flops_per_token(arch, context, True)
                      + forward * model_flops_per_token(arch, context, False))
    if passes["teacher"]:
        flops += tokens * passes["teacher"] * model_flops_per_token(teacher_arch, context, False)
    return flops


def full_rows_batch(rows: int, length: int, prompt: int, vocab: int):
    """A step's batch of random tokens at full length: `prompt` prompt tokens, then a completion to the row's end."""
    from grpo_stream.trainer_service.learning.batching import TrainBatch

    rng = np.random.default_rng(0)
    completions = np.arange(length - 1) >= prompt - 1
    return TrainBatch(tokens=rng.integers(1, vocab, (rows, length)).astype(np.int32),
                      valid=np.ones((rows, length), bool), loss_mask=np.tile(completions, (rows, 1)).astype(np.float32),
                      behaviour_logprobs=np.full((rows, length - 1), -3.0, np.float32),
                      advantages=rng.normal(size=rows).astype(np.float32), fresh=np.ones(rows, np.float32))


def trainer(config: pathlib.Path, quick: bool, plan_json: pathlib.Path | None, deadline: float, write,
            overrides: list[str] | None = None) -> dict:
    from grpo_stream.bench.sampler_workloads import time_left_for
    from grpo_stream.common.config.loading import load_config
    from grpo_stream.common.model.policy import build_from_architecture
    from grpo_stream.common.model.sharding import make_mesh, place
    from grpo_stream.common.assembly.compilation_cache import enable_compilation_cache
    from grpo_stream.plan.programs import architecture, model_dtype, trainer_programs
    from grpo_stream.trainer_service.learning.packing import packing_layout
    from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater, state_report

    # a fresh persistent compilation cache: the step compiles cold for the run, and the analysis after it (the
    # same program, lowered from abstract arrays as `plan` lowers it) reads it back instead of compiling again
    cache = tempfile.mkdtemp(prefix="bench-gpu-jax-cache-")
    cfg = load_config(config, (QUICK_TRAINER if quick else [f"model.path={SHAPE}"])
                      + [f"runtime.compilation_cache_dir={cache}", *(overrides or [])])
    cache_stats = enable_compilation_cache(cfg)
    t, gen = cfg.trainer, cfg.generation
    arch = architecture(cfg)
    out: dict = {"config": str(config), "overrides": overrides or [], "shape": "tiny" if quick else SHAPE, **device_facts()}
    if plan_json is not None:
        out["plan_cpu_estimate"] = json.loads(plan_json.read_text())["trainer"]["per_device_bytes"]
    mesh = make_mesh(t.mesh.fsdp, t.mesh.tp, jax.devices(), "trainer.mesh")
    model = build_from_architecture(arch, 0, model_dtype(cfg))
    step_model, params, trainable, lora = model.with_remat(t.remat), place(model.params, mesh), None, None
    if cfg.model.lora is not None:  # --set model.lora.rank=R: adapters only, as the trainer trains them
        from grpo_stream.common.model.lora import apply_lora
        lora = apply_lora(step_model, params, cfg.model.lora, 0)
        step_model, params, trainable = lora.adapted, lora.adapted.params, lora.trainable()
    updater = PolicyUpdater(step_model, params, cfg.algo, t.learning_rate, t.max_grad_norm, gen.temperature, 0,
                            packing_layout(cfg, t.mesh.fsdp, arch), mesh, t.optimizer, t.steps, donate=True,
                            trainable=trainable)
    model_params = model.num_params()
    out.update(state_report(updater, model_params, lora))
    del model, params
    rows, length = t.groups_per_step * gen.num_generations, gen.max_prompt_tokens + gen.max_new_tokens
    batch = full_rows_batch(rows, length, gen.max_prompt_tokens, arch.vocab_size)
    resident = memory_stats()
    progress(f"trainer: first update of {model_params / 1e9:.3g}B parameters (compiles), then up to 3 timed")
    first = time.perf_counter()
    updater.update(batch)  # compiles the forward passes it runs (update_passes) and the update step
    out["first_step_seconds"] = round(time.perf_counter() - first, 1)
    times = []
    while len(times) < 3 and (not times or time_left_for(times[-1], deadline)):
        began = time.perf_counter()
        metrics = updater.update(batch)
        times.append(time.perf_counter() - began)
    step = float(np.median(times))
    tokens = rows * length
    passes = update_passes(updater)
    flops = update_flops(arch, tokens, length, passes, updater.teacher.model.arch if updater.teacher else None)
    peak = peak_flops(out["device_kind"])
    out.update({"rows": rows, "tokens_per_step": tokens, "remat": t.remat, "micro_batch_size": t.micro_batch_size,
                "step_seconds": [round(x, 3) for x in times], "step_seconds_median": round(step, 3),
                "model_flops_per_step": flops, "passes_per_step": passes,
                "achieved_tflops": round(flops / step / 1e12, 1),
                # LoRA computes no weight gradients of the base: the full fine-tuning FLOPs would overstate its work
                "mfu": round(flops / step / peak, 3) if peak and lora is None else None, "peak_bf16_flops": peak,
                "loss_finite": bool(np.isfinite(metrics["loss"])),
                "memory_before_step": resident, "memory_after_steps": memory_stats()})
    measured = out["memory_after_steps"].get("peak_bytes_in_use")
    if measured and "plan_cpu_estimate" in out:
        out["measured_peak_over_plan_cpu"] = round(measured / out["plan_cpu_estimate"]["total"], 3)
    write(out)
    if lora is not None:  # plan compiles the full fine-tuning step: nothing to compare with
        out["xla_this_backend"] = {"skipped": "model.lora (plan models full fine-tuning)"}
    elif time.perf_counter() < deadline:
        progress("trainer: XLA's memory analysis of the same step, compiled for this backend")
        started = time.perf_counter()
        planned = trainer_programs(cfg, arch)  # compiled for this backend, as `plan` compiles it for CPU
        out["xla_this_backend"] = {"per_device_bytes": planned["per_device_bytes"], "seconds":
                                   round(time.perf_counter() - started, 1), "cache_hits": cache_stats.hits}
        if measured:
            out["measured_peak_over_xla_this_backend"] = round(measured / planned["per_device_bytes"]["total"], 3)
    else:
        out["xla_this_backend"] = {"skipped": "deadline"}
    return out


def sampler_model(quick: bool):
    from grpo_stream.common.model.known_architectures import known_architecture
    from grpo_stream.common.model.policy import build_from_architecture

    arch = known_architecture(SHAPE)
    if quick:
        arch = dataclasses.replace(arch, vocab_size=512, num_layers=2, embed_dim=64, hidden_dim=128, num_heads=2,
                                   num_kv_heads=1, head_dim=32)
    return build_from_architecture(arch, 0, jnp.bfloat16)


def sampler(quick: bool, deadline: float, write) -> dict:
    import torch

    from grpo_stream.bench.sampler import load_hf
    from grpo_stream.bench.sampler_workloads import (NO_EOS, longtail_budgets, make_prompts, time_hf,
                                                     time_jax_engine)
    from grpo_stream.bench.static_engine import StaticEngine
    from grpo_stream.common.engine.continuous import ContinuousEngine

    p = QUICK_SAMPLER if quick else FULL_SAMPLER
    model = sampler_model(quick)
    torch_device = "cuda" if torch.cuda.is_available() and jax.default_backend() == "gpu" else "cpu"
    out: dict = {"shape": "tiny" if quick else SHAPE, "params": model.num_params(), "dtype": "bfloat16",
                 **{k: p[k] for k in p}, **device_facts(), "torch": torch.__version__, "torch_device": torch_device}
    hf, diff = load_hf(model, "bfloat16", torch_device)
    # bfloat16 on both sides rounds differently (a few per cent over 16 layers); a wrong architecture is O(1) off
    out["logits_max_rel_diff"] = round(diff, 4)
    out["logits_agree"] = diff < 0.1
    prompts = make_prompts(p["prompts"], p["generations"], p["prompt_low"], p["prompt_high"],
                           model.arch.vocab_size, 0)
    cases = {"longtail": longtail_budgets(len(prompts), p["max_new_tokens"], p["max_new_tokens"] / 4, 0.9, seed=1),
             "fixed": [p["max_new_tokens"]] * len(prompts)}
    for name, budgets in cases.items():
        out[name] = {"useful_tokens": int(sum(budgets)), "budget_median": int(np.median(budgets)),
                     "budget_max": int(max(budgets)), "engines": {}}
    args = (model, 0, NO_EOS, p["prompt_high"], p["max_new_tokens"], 1.0)

    def continuous() -> ContinuousEngine:
        return ContinuousEngine(*args, slots=p["slots"], chunk_steps=p["chunk_steps"])

    # (case, engine name, how to time it), most wanted first: the deadline cuts from the end
    stages = [("longtail", "ours", continuous()), ("longtail", "hf", None), ("fixed", "ours", continuous()),
              ("longtail", "static", StaticEngine(*args))]
    for case, name, engine in stages:
        if time.perf_counter() > deadline:
            out[case]["engines"][name] = {"skipped": "deadline"}
            continue
        progress(f"sampler: {case} / {name}")
        if engine is None:  # HF batches statically: both cases are the same work, timed once
            timed = time_hf(hf, prompts, cases, p["repeats"], torch_device, deadline)
            for c in cases:
                out[c]["engines"]["hf"] = timed[c]
        else:
            result = time_jax_engine(engine, model.params, prompts, cases[case], p["repeats"], deadline)
            if hasattr(engine, "stats"):
                result.update(programs_compiled=len(engine.programs),
                              slot_use=round(engine.stats["live_slot_steps"] / max(engine.stats["slot_steps"], 1), 3))
            out[case]["engines"][name] = result
        for c in cases:
            rate = {k: v["tokens_per_second"] for k, v in out[c]["engines"].items() if "tokens_per_second" in v}
            for other in ("static", "hf"):
                if "ours" in rate and other in rate:
                    out[c][f"ratio_vs_{other}"] = round(rate["ours"] / rate[other], 3)
        write(out)
    return out


def time_load(engine, params, prompts: list[list[int]], budget: int, repeats: int, deadline: float) -> dict:
    """`prompts` at `budget` new tokens each, timed as `time_jax_engine` times a request set with the engine's stop
    tokens kept (a row that samples one ends early: rare for a random-init model, and the sampler's engine ends it
    too), with the rows the engine decoded per step over these runs."""
    from grpo_stream.bench.sampler_workloads import time_jax_engine
    from grpo_stream.common.engine.base import decoded_rows_per_step

    before = dict(engine.stats)
    result = time_jax_engine(engine, params, prompts, [budget] * len(prompts), repeats, deadline, stop_tokens=True)
    return {**result, "budget_tokens": budget * len(prompts),
            "rows_decoding_mean": decoded_rows_per_step({k: v - before.get(k, 0) for k, v in engine.stats.items()})}


def run_engine(config: pathlib.Path, overrides: list[str], loads: list[int] | None, deadline: float, write) -> dict:
    """The engine of a sampler of the run (`config` with `overrides`) alone on this device (module doc), handed each
    of `loads` rows at once (default: the whole groups its sampler keeps in flight, which fill it), each load's
    tokens/s; `tokens_per_second` is the first load's, set as soon as it is measured."""
    from grpo_stream.common.assembly.compilation_cache import enable_compilation_cache
    from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
    from grpo_stream.common.config.loading import load_config
    from grpo_stream.common.engine import continuous

    cfg = load_config(config, overrides)
    gen = cfg.generation
    # what its sampler holds: whole groups (a load of rows_in_flight itself would be refused below when the slots are
    # not a multiple of the group, and gpu-check's engine phase with it, its admitted rows' load unmeasured)
    full = cfg.rows_held()
    loads = loads or [full]
    if bad := [n for n in loads if n < gen.num_generations or n % gen.num_generations]:
        raise SystemExit(f"--rows {bad[0]}: a load is whole groups, a multiple of generation.num_generations="
                         f"{gen.num_generations}")
    enable_compilation_cache(cfg)  # runtime.compilation_cache_dir: programs of the same shapes load, not compile
    task, tok = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tok.vocab_size, seed=0, dtype=cfg.sampler_dtype())
    engine = continuous.build(cfg, model, tok)  # the sampler's engine, its stop tokens included
    stream, groups = task.train_stream(0, cfg.sampler.replicas, 0), []
    while len(groups) < max(loads) // gen.num_generations:
        ids = tok.encode(next(stream).prompt)
        if len(ids) <= gen.max_prompt_tokens:  # the sampler skips longer ones too
            groups.append(ids)
    out: dict = {"config": str(config), "overrides": overrides, "params": model.num_params(),
                 "dtype": cfg.sampler_dtype(), "rows": full, "slots": gen.decode_slots,
                 "chunk_steps": gen.decode_chunk_steps, "max_new_tokens": gen.max_new_tokens,
                 "prompt_tokens_median": int(np.median([len(g) for g in groups])), **device_facts(), "loads": {},
                 "tokens_per_second": None}
    for rows in loads:
        if out["loads"] and time.perf_counter() > deadline:
            out["loads"][str(rows)] = {"skipped": "deadline"}
            continue
        prompts = [ids for ids in groups[:rows // gen.num_generations] for _ in range(gen.num_generations)]
        progress(f"engine: {len(prompts)} rows of {gen.max_new_tokens} new tokens, {gen.decode_slots} slots")
        out["loads"][str(rows)] = time_load(engine, model.params, prompts, gen.max_new_tokens, 3, deadline)
        out["tokens_per_second"] = out["loads"][str(loads[0])]["tokens_per_second"]
        out["programs_compiled"] = len(engine.programs)
        write(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("trainer", "sampler", "engine"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes (tests)")
    parser.add_argument("--config", type=pathlib.Path, help="trainer: the run config whose trainer settings are "
                        f"measured (default {PRESET}; model.path is set to the Llama-3.2-1B shape); engine: the run "
                        "whose sampler's engine is measured (required)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench/gpu.json"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="trainer, engine: a config override (e.g. trainer.remat=save_dots); repeatable")
    parser.add_argument("--rows", type=int, action="append", help="engine: rows handed to it at once, one timed "
                        "load each (repeatable; the first is its `tokens_per_second`); default: what its sampler keeps "
                        "in flight")
    parser.add_argument("--plan-json", type=pathlib.Path, help="`grpo-stream plan --json` of the same config (CPU)")
    parser.add_argument("--deadline-s", type=float, default=3600.0, help="start no stage after this many seconds")
    args = parser.parse_args(argv)
    # an option another part reads would be dropped here without a word (a --set on `sampler` measuring the default)
    ignored = {"--config": args.config is not None and args.part == "sampler",
               "--set": bool(args.set) and args.part == "sampler",
               "--rows": bool(args.rows) and args.part != "engine",
               "--plan-json": args.plan_json is not None and args.part != "trainer"}
    if unused := [option for option, given in ignored.items() if given]:
        parser.error(f"{', '.join(unused)}: not read by the {args.part} part (see --help for which part reads each)")
    deadline = time.perf_counter() + args.deadline_s
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(doc: dict) -> None:  # whole or not at all: a run stopped mid-write leaves the last document
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(args.out)

    if args.part == "trainer":
        write(trainer(args.config or PRESET, args.quick, args.plan_json, deadline, write, args.set))
    elif args.part == "engine":
        if args.config is None:
            parser.error("engine needs --config: the run whose sampler's engine is measured")
        write(run_engine(args.config, args.set, args.rows, deadline, write))
    else:
        write(sampler(args.quick, deadline, write))
    progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
