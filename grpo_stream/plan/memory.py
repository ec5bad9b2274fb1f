"""`grpo-stream plan --config C [k=v ...] [--json F]`: does the config fit its hardware, before the hardware exists?

The run's programs are compiled on this machine's CPU for fake devices of the target count (plan_programs.py, in a
child process started with --xla_force_host_platform_device_count), and XLA's memory analysis of each gives the
bytes per device by category: parameters, optimizer state, gradients, activations, KV cache. Those are compared with
the memory of the chips `hardware:` names, less `hardware.margin`. Exit 0 when trainer and sampler fit, 1 when
either does not (the report names the cheapest fixes), 2 when the config cannot be planned.

The figures are XLA's own for these programs, partitioned as on the real mesh, but compiled by the CPU backend:
TPU and GPU compilers fuse more and reuse buffers differently, so treat them as an estimate. The child compiles with
CPU_PLAN_FLAGS, which turn off three CPU habits the accelerators' compilers do not share (below). How to read the
report: docs/plan.md. How the estimate compares with measured peaks (an H200, the CPU): BENCHMARKS.md, "plan".
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

from grpo_stream.arguments import check_json_path
from grpo_stream.common.config.hardware import CHIP_MEMORY_BYTES, CPU_CHIP, GIB
from grpo_stream.common.config.loading import apply_overrides
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.registry.transports import transport_spec
from grpo_stream.plan.host_memory import evaluation_rows, host_estimates, host_fit, host_lines

LORA_NOTE = ("model.lora: rank {rank} adapters, {trained:,} trained parameters ({share:.2%} of the model): the "
             "trainer's optimizer state, gradients and reference copy are the adapters'; a sampler keeps the frozen "
             "base on its devices beside the merged weights (lora_base) and merges each version into it (lora_merge)")
ESTIMATE_NOTE = ("CPU-compiled estimate: XLA's memory analysis of the real programs, partitioned for the target "
                 "device count, but compiled by the CPU backend, whose fusion and buffer reuse differ from TPU and "
                 "GPU compilers (on an H200 a Llama-3.2-1B update step peaked below this estimate, the difference in "
                 "activations and temporaries; no TPU measurement exists: docs/plan.md, and BENCHMARKS.md, \"plan\").")


# Three habits of XLA's CPU backend that TPU and GPU compilers do not share, turned off for the plan's compiles:
# - it orders a program's instructions for concurrency, starting independent work early and keeping its buffers
#   alive: a Llama-3.2-1B update step's temporaries came to 23.2 GiB against 1.6 measured on an H200; the
#   memory-minimising order, which TPU and GPU schedulers approximate under their memory limit, gives 8.1 GiB;
# - it merges every all-reduce of a step into one (`cpu-all-reduce-combiner`), so with FSDP the float32 gradient of
#   every weight is whole on each device at once (the CPU has no reduce-scatter: each weight's is an all-reduce and a
#   slice); TPU and GPU reduce-scatter each layer's and combine only up to a size threshold. The same step on fsdp=8
#   kept 14.9 GiB of temporaries per device with the merge, 9.8 without;
# - it has no bfloat16 matrix product: it converts each bfloat16 operand to float32 first, and loop-invariant code
#   motion hoisted the weights' converts out of the decode chunk's step loop, so the chunk held a float32 copy of
#   every weight at once (Llama 3.1 8B on tp 2: 15 GiB of temporaries per device, 2.4 without the hoisting); TPU and
#   GPU multiply bfloat16 natively and have no such converts to hoist. A run on the CPU does hoist them, so this pass
#   stays on for a plan of CPU processes (ACCELERATOR_PLAN_PASSES). (The trainer's gathered weights pass an
#   optimisation barrier per micro-batch, so nothing of theirs is hoisted either way.)
CPU_PLAN_FLAGS = ("--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",)
CPU_PLAN_PASSES = ("cpu-all-reduce-combiner",)
ACCELERATOR_PLAN_PASSES = ("while-loop-invariant-code-motion",)


def child_env(devices: int, accelerators: bool = True) -> dict[str, str]:
    """This environment with JAX on CPU, `devices` fake devices (any earlier device-count flag replaced) and the
    CPU_PLAN_FLAGS; `accelerators`: the plan is for TPU or GPU devices, not a run on the CPU (one more pass off)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+|--xla_cpu_scheduler_type=\S+", "",
                   env.get("XLA_FLAGS", "")).strip()
    passes = ",".join((*CPU_PLAN_PASSES, *(ACCELERATOR_PLAN_PASSES if accelerators else ())))
    env["XLA_FLAGS"] = " ".join([flags, f"--xla_force_host_platform_device_count={devices}", *CPU_PLAN_FLAGS,
                                 f"--xla_disable_hlo_passes={passes}"]).strip()
    env["JAX_PLATFORMS"] = "cpu"
    return env


def compile_programs(cfg: RunConfig) -> dict:
    """The child's report: every program compiled for abstract inputs on fake devices of the target count."""
    devices = max(cfg.trainer.mesh.fsdp * cfg.trainer.mesh.tp, cfg.sampler.mesh.tp)
    proc = subprocess.run([sys.executable, "-m", "grpo_stream.plan.programs"], input=cfg.model_dump_json(),
                          capture_output=False, stdout=subprocess.PIPE, text=True,
                          env=child_env(devices, accelerators=not cfg.hardware.any_on_cpu()))
    if proc.returncode != 0:
        raise RuntimeError(f"compiling the run's programs for {devices} fake devices failed (exit "
                           f"{proc.returncode}); its error is printed above")
    return json.loads(proc.stdout)


def gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):,.1f} MiB"


def trainer_fixes(cfg: RunConfig, sizes: dict) -> list[str]:
    """Changes that shrink the trainer's largest categories, cheapest (no more hardware) first."""
    t, fixes = cfg.trainer, []
    rows = t.groups_per_step * cfg.generation.num_generations // cfg.algo.minibatches
    activations = sizes["activations_and_temporaries"]
    state = sizes["parameters"] + sizes["optimizer_state"] + sizes["gradients"] + sizes["updated_state"]
    if activations > 0.2 * sizes["total"]:
        if t.remat == "none":
            fixes.append(f"trainer.remat=full: recompute each decoder layer in the backward pass (activations and "
                         f"temporaries are {gib(activations)} per device); trainer.remat=save_dots keeps the "
                         "layers' matrix-product outputs: less saved, less recomputed")
        packing = sizes.get("packing")
        if packing is not None and packing["rows"] > t.mesh.fsdp and t.packing:
            smaller = max(t.mesh.fsdp, packing["rows"] // 2) * packing["row_tokens"]
            fixes.append(f"trainer.tokens_per_micro_batch={smaller}: smaller packed passes, gradients accumulated "
                         f"(now {packing['tokens_per_pass']} tokens, {packing['rows']} rows of "
                         f"{packing['row_tokens']}, per pass); activations follow this budget")
        elif packing is not None and packing["rows"] > t.mesh.fsdp and rows % t.mesh.fsdp == 0:
            fixes.append(f"trainer.micro_batch_size={t.mesh.fsdp}: one sequence per device per pass, gradients "
                         f"accumulated (now {packing['rows']} sequences per pass)")
        fixes.append(f"generation.max_new_tokens below {cfg.generation.max_new_tokens}: activations grow with the "
                     "sequence length")
    if cfg.model.lora is None and sizes["optimizer_state"] > 0.2 * sizes["total"] and accepted(
            cfg, ["model.lora.rank=16"]):  # not with a multi-process trainer, which the loader refuses LoRA
        fixes.append(f"model.lora.rank=16: train low-rank adapters only; optimizer state, gradients and the "
                     f"reference copy shrink to the adapters' (about 1% of the model's: the optimizer state is now "
                     f"{gib(sizes['optimizer_state'])})")
    if cfg.algo.beta > 0:
        fixes.append(f"algo.beta=0: no reference copy of the parameters (saves {gib(sizes['reference_parameters'])})")
    teacher = sizes.get("teacher_parameters", 0)
    if teacher > 0.2 * sizes["total"] and cfg.distill.dtype != "bfloat16":
        fixes.append(f"distill.dtype=bfloat16: halves the distillation teacher's parameters (now {gib(teacher)})")
    evaluation = sizes.get("evaluation", 0)
    # the rows are max(eval.batch_size, eval.samples), at most decode_slots (evaluation_rows): a smaller batch_size
    # is offered only where it lowers them, not where one problem's samples or the slots set them
    fewer = min(cfg.generation.decode_slots, max(cfg.eval.batch_size // 2, cfg.eval.samples))
    if evaluation > 0.2 * sizes["total"] and fewer < evaluation_rows(cfg):
        fixes.append(f"eval.batch_size={cfg.eval.batch_size // 2}: half the rows the held-out evaluation decodes at "
                     f"once on the trainer's devices (its KV cache is whole on each fsdp device; the evaluation is "
                     f"{gib(evaluation)} per device now)")
    if sizes.get("publication_copy", 0) > 0.1 * sizes["total"]:
        fixes.append(f"weights.publish_copy=false: no copy of the trained parameters for the publication (saves "
                     f"{gib(sizes['publication_copy'])}); each update then waits until the previous publication "
                     "has read the parameters")
    if cfg.model.dtype == "float32":
        fixes.append("model.dtype=bfloat16: halves parameters and gradients (the optimizer keeps float32 state)")
    elif cfg.trainer.optimizer.state_dtype == "float32":
        # 12 bytes per parameter (float32 copy and moments) against 4 (bfloat16 moments)
        fixes.append(f"trainer.optimizer.state_dtype=params: bfloat16 moments and no float32 master copy (saves "
                     f"{gib(sizes['optimizer_state'] * 2 // 3)}; updates below bfloat16's resolution are lost)")
    fixes.append(f"trainer.mesh.fsdp={2 * t.mesh.fsdp}: twice the devices share parameters, optimizer state and "
                 f"gradients (saves about {gib(state / 2)} per device) and the batch rows")
    return fixes


def sampler_fixes(cfg: RunConfig, sizes: dict, slots: int) -> list[str]:
    fixes = []
    fewer = fewer_rows(cfg, slots) if sizes["kv_cache"] > 0.2 * sizes["total"] and slots > 8 else None
    if fewer is not None:
        fixes.append(f"{' '.join(fewer)}: half the rows decoded at once, half the KV cache of "
                     f"{gib(sizes['kv_cache'])}")
    if cfg.sampler_dtype() == "float32":
        fixes.append("sampler.dtype=bfloat16: halves the samplers' weights and KV cache (the trainer's dtype stays)")
    fixes.append(f"sampler.mesh.tp={2 * cfg.sampler.mesh.tp}: twice the devices share the weights")
    return fixes


def accepted(cfg: RunConfig, overrides: list[str]) -> bool:
    """Whether the config loader takes `cfg` with these dotted overrides: a fix is printed to be applied as it
    stands, so one the loader would refuse is not offered."""
    try:
        RunConfig.model_validate(apply_overrides(cfg.model_dump(mode="json", exclude_unset=True), overrides))
    except ValueError:  # pydantic's ValidationError and ConfigError are ValueErrors
        return False
    return True


def fewer_rows(cfg: RunConfig, slots: int) -> list[str] | None:
    """The overrides that halve the `slots` a sampler's KV cache holds, as the loader accepts them: the KV cache
    holds min(generation.decode_slots, sampler.rows_in_flight) rows, so sampler.rows_in_flight where it sets them,
    else generation.decode_slots, lowering rows_in_flight with it where it would exceed the slots (refused for
    single-turn rows); None when half the slots would hold no group (generation.num_generations)."""
    half, rows = slots // 2, cfg.sampler.rows_in_flight
    candidates = [[f"sampler.rows_in_flight={half}"]] if rows is not None and rows < cfg.generation.decode_slots \
        else []
    candidates += [[f"generation.decode_slots={half}"],
                   [f"generation.decode_slots={half}", f"sampler.rows_in_flight={half}"]]
    return next((c for c in candidates if accepted(cfg, c)), None)


def verdict(cfg: RunConfig, role: str, report: dict) -> dict:
    """`report` (one role's part of the child's output) with its memory, usable share, fit and fixes added."""
    hw = cfg.hardware
    memory = hw.device_memory_bytes(role)
    # on the CPU the process's whole resident memory must fit, not only its devices' arrays (host_memory.py)
    need = report.get("host_peak_bytes", report["per_device_bytes"]["total"])
    report["chip"] = hw.chip(role)
    report["device_memory_bytes"] = memory
    report["usable_bytes"] = int(memory * (1 - hw.margin))
    report["fits"] = need <= report["usable_bytes"]
    if not report["fits"]:
        report["fixes"] = (trainer_fixes(cfg, {**report["per_device_bytes"], "packing": report.get("packing")})
                           if role == "trainer"
                           else sampler_fixes(cfg, report["per_device_bytes"], report["slots"]))
    return report


def device_fit(cfg: RunConfig, doc: dict) -> dict:
    """The device plan of hardware.gpus GPUs with this report's figures (grpo_stream/plan/device_plan.py): each
    process's GPUs and share, or why the layout cannot work."""
    from grpo_stream.plan.device_plan import DeviceLayoutError, plan_devices  # noqa: PLC0415

    try:
        plan = plan_devices(cfg, [str(g) for g in range(cfg.hardware.gpus)], cfg.hardware.device_memory_bytes(
            "trainer"), doc)
    except DeviceLayoutError as exc:
        return {"fits": False, "error": str(exc)}
    return {"fits": True, "lines": plan.lines(), **plan.to_json()}


def render(cfg: RunConfig, doc: dict) -> str:
    lines = [f"model: {doc['trainer']['parameters'] / 1e9:.3g}B parameters ({doc['architecture']['family']}, "
             f"{cfg.model.dtype}, samplers {cfg.sampler_dtype()}); {ESTIMATE_NOTE}"]
    if "lora_note" in doc:
        lines.append(doc["lora_note"])
    for role in ("trainer", "sampler"):
        r = doc.get(role)
        if r is None:
            lines.append(f"\nsampler: not planned: sampler.engine={cfg.sampler.engine} sizes its own memory "
                         "(sampler.vllm.gpu_memory_utilization)")
            continue
        mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
        packed = r.get("packing")
        kind = "packed passes" if packed and packed["segments_per_row"] > 1 else "passes (one sequence a row)"
        passes = (f", {kind} of {packed['rows']} rows x {packed['row_tokens']} tokens "
                  f"({packed['tokens_per_pass']:,} per pass)" if packed else "")
        lines.append(f"\n{role}: {r['devices']} x {r['chip'] or 'device'} ({gib(r['device_memory_bytes'])} each, "
                     f"{gib(r['usable_bytes'])} usable at margin {cfg.hardware.margin}), mesh {mesh}{passes}; "
                     "per device:")
        for name, n in r["per_device_bytes"].items():
            if name != "total":
                lines.append(f"  {name:<28} {gib(n):>14}")
        total = r["per_device_bytes"]["total"]
        fit = f"{'fits' if r['fits'] else 'DOES NOT FIT'} (peak in {r['peak_program']})"
        if "host_peak" in r:
            fit = "the devices' arrays, part of the process's memory below"
        lines.append(f"  {'total':<28} {gib(total):>14}  {total / r['usable_bytes']:.0%} of usable: {fit}")
        if "host_peak" in r:
            lines.extend(host_lines(role, r["host_peak"], gib))
            lines.append(f"    {r['host_peak_bytes'] / r['usable_bytes']:.0%} of usable: "
                         f"{'fits' if r['fits'] else 'DOES NOT FIT'}")
        teacher = r.get("teacher")
        if teacher is not None:
            lines.append(f"  distillation teacher: {teacher['parameters'] / 1e9:.3g}B parameters "
                         f"({teacher['architecture']['family']}), {gib(teacher['parameters_bytes'])} per device; its "
                         f"forwards {teacher['forward_flops_per_step'] / 1e12:,.3g} TFLOP per step")
        for fix in r.get("fixes", []):
            lines.append(f"    fix: {fix}")
    shared = doc.get("shared_devices")
    if shared:
        lines.append(f"\nshared devices ({shares_devices(cfg)}): trainer + {cfg.sampler.replicas} sampler(s) "
                     f"{gib(shared['total_bytes'])} of {gib(shared['usable_bytes'])} usable: "
                     f"{'fits' if shared['fits'] else 'DOES NOT FIT'}")
    host = doc.get("cpu_host")
    if host:
        lines.append(f"\non this machine: trainer x {cfg.trainer.processes} + sampler x {cfg.sampler.replicas} "
                     f"expected peaks {gib(host['total_bytes'])} of {gib(host['usable_bytes'])} usable: "
                     f"{'fits' if host['fits'] else 'DOES NOT FIT'}")
    devices = doc.get("devices")
    if devices:
        lines.append(f"\non {cfg.hardware.gpus} GPU(s) (hardware.gpus), as `up` would lay the processes out:")
        lines.extend(devices["lines"] if devices["fits"] else [f"  DOES NOT FIT: {devices['error']}"])
    lines.append(f"\n{'fits' if doc['fits'] else 'does not fit'}")
    return "\n".join(lines)


def run_plan(cfg: RunConfig, json_path: pathlib.Path | None) -> int:
    if json_path is not None:  # refused before the compiles (minutes for a large model), not after them
        check_json_path(json_path)
    for role in ("trainer", "sampler"):
        if cfg.hardware.device_memory_bytes(role) is None:
            raise ValueError(f"hardware.{role}_chip: plan needs the accelerator the run is sized for (one of "
                             f"{', '.join((*CHIP_MEMORY_BYTES, CPU_CHIP))}), or hardware.{role}_memory_gib")
    from grpo_stream.plan.programs import architecture  # noqa: PLC0415  (JAX only once the config is sound)

    arch = architecture(cfg)  # a model plan cannot size fails here, with model.path named, before any compiling
    check_teacher(cfg, arch)
    doc = compile_programs(cfg)
    estimates = host_estimates(cfg, doc)
    for role, estimate in estimates.items():  # a run on the CPU: each process's expected peak resident memory
        doc[role]["host_peak"], doc[role]["host_peak_bytes"] = estimate, estimate["total"]
    doc["trainer"] = verdict(cfg, "trainer", doc["trainer"])
    if "sampler" in doc:
        doc["sampler"] = verdict(cfg, "sampler", doc["sampler"])
    doc["fits"] = all(doc[r]["fits"] for r in ("trainer", "sampler") if r in doc)
    if shares_devices(cfg) and "sampler" in doc:  # one set of devices holds the trainer and every sampler
        together = doc["trainer"]["per_device_bytes"]["total"] + (
            cfg.sampler.replicas * doc["sampler"]["per_device_bytes"]["total"])
        doc["shared_devices"] = {"total_bytes": together, "usable_bytes": doc["trainer"]["usable_bytes"],
                                 "fits": together <= doc["trainer"]["usable_bytes"]}
        doc["fits"] = doc["fits"] and doc["shared_devices"]["fits"]
    if estimates:  # the run's processes share this machine's memory
        doc["cpu_host"] = host_fit(cfg, estimates, doc["trainer"]["usable_bytes"])
        doc["fits"] = doc["fits"] and doc["cpu_host"]["fits"]
    if cfg.hardware.gpus:  # the processes `up` would start on that many GPUs, with these figures as their needs
        doc["devices"] = device_fit(cfg, doc)
        doc["fits"] = doc["fits"] and doc["devices"]["fits"]
    doc["estimate_note"] = ESTIMATE_NOTE
    if cfg.model.lora is not None:
        t = doc["trainer"]
        doc["lora_note"] = LORA_NOTE.format(rank=cfg.model.lora.rank, trained=t["trained_parameters"],
                                            share=t["trained_parameters"] / t["parameters"])
    print(render(cfg, doc))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=1))
    return 0 if doc["fits"] else 1


def check_teacher(cfg: RunConfig, arch) -> None:
    """The distillation teacher's shape, read before any compiling (a ValueError naming distill.teacher, as for
    model.path): one plan cannot size, or one whose embedding has fewer rows than the student's, which the trainer
    refuses at start (it could not score every id the student samples: trainer_service/learning/distill.py)."""
    if not cfg.distill.enabled:
        return
    from grpo_stream.plan.programs import checkpoint_architecture  # noqa: PLC0415

    teacher = checkpoint_architecture(cfg.distill.teacher, "distill.teacher")
    if teacher.vocab_size < arch.vocab_size:
        raise ValueError(f"distill.teacher={cfg.distill.teacher}: its embedding has {teacher.vocab_size} rows, fewer "
                         f"than the student's {arch.vocab_size}, so it cannot score every id the student samples and "
                         "the trainer refuses it; pick a teacher of the student's tokenizer whose config.json's "
                         f"vocab_size is at least {arch.vocab_size}")


def shares_devices(cfg: RunConfig) -> str | None:
    """Why the trainer and the samplers hold the same devices (the setting that says so), or None: hardware.
    shared_devices, or weights.transport=local (one process) with both device shares 1, the default, which `up`
    runs as `colocated` on every device for both (other overlapping shares are refused there)."""
    if cfg.hardware.shared_devices:
        return "hardware.shared_devices"
    w = cfg.weights
    if transport_spec(w.transport).in_process and w.trainer_devices_fraction == w.sampler_devices_fraction == 1.0:
        return f"weights.transport={w.transport} with both device shares 1"
    return None
