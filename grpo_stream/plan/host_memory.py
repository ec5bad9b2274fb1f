"""A run on the CPU (hardware.trainer_chip / sampler_chip: cpu): each process's expected peak resident memory.

On the CPU a process's devices are its own memory, and beside their arrays (the plan's per-device figures) it holds
the Python runtime and its libraries, what compiling its programs left, and host-side copies its work makes. The
estimate adds those parts; each is either measured by the plan's child process (which imports the services, builds
the task and tokenizer and compiles the same programs: grpo_stream/plan/resident.py) or follows from the config:

trainer: runtime + devices + compiled programs + the checkpoint's copy of the state (an asynchronous save keeps
  parameters and optimizer state alive while the next update writes new ones) + the held-out evaluation's engine
  (its programs' compile; its decode layout and KV cache are the devices' arrays, plan/evaluation.py);
sampler: runtime + devices + compiled programs (its engine frees a version's decode layout before it makes the next
  one's: common/engine/continuous.py, serve).

Left out: what the C allocator keeps after arrays are freed (glibc's per-thread arenas), so the estimate errs low.
Measured against `up` on configs/smollm2_arith.yaml: docs/plan.md and BENCHMARKS.md (issue 58).
"""

from __future__ import annotations

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.registry.transports import transport_spec

# what each part is, as the report prints it
PARTS = {
    "runtime": "Python, JAX, the services' modules, the task and tokenizer (measured in plan's child)",
    "devices": "the devices' arrays above, for the process's {devices} device(s)",
    "compiled_programs": "what compiling its programs left in memory (measured in plan's child; a sampler's decode "
                         "program at each of its sizes)",
    "checkpoint_copy": "parameters, optimizer state and reference held by a checkpoint save while the next update "
                       "writes new ones",
    "evaluation_engine": "the held-out evaluation's engine ({rows} rows): its programs' compile (its decode layout "
                         "and KV cache are in the devices' arrays)",
}


def host_estimates(cfg: RunConfig, doc: dict) -> dict[str, dict]:
    """{role: {parts, total, notes}} for the roles whose processes run on the CPU, from the child's report `doc`
    (its per-device figures and `host_measured`); empty when none does or the child measured nothing."""
    measured = doc.get("host_measured")
    if measured is None:
        return {}
    out = {}
    if cfg.hardware.on_cpu("trainer"):
        out["trainer"] = trainer_estimate(cfg, doc, measured)
    if cfg.hardware.on_cpu("sampler") and "sampler" in doc:
        out["sampler"] = sampler_estimate(cfg, doc["sampler"], measured)
    return out


def common_parts(report: dict, measured: dict, role: str, devices: int,
                 compiled: int) -> tuple[dict[str, int], list[str]]:
    """The runtime, the devices' arrays (all of the process's devices live in its memory) and the compile."""
    notes = []
    runtime = measured["runtime"]
    if runtime.get("note"):
        notes.append(f"runtime measured {runtime['note']}")
    if runtime.get("bytes") is None or measured.get(f"{role}_compile") is None:
        notes.append("the runtime and the compile were not measured (needs Linux's /proc): counted as 0")
    parts = {"runtime": runtime.get("bytes") or 0, "devices": report["per_device_bytes"]["total"] * devices,
             "compiled_programs": compiled}
    return parts, notes


def engine_compile(sampler: dict, measured: dict, who: str) -> int:
    """The sampler programs' compile measured in plan's child, and a decode program's for each further slot count
    and window that `who` (sampler, evaluation) decodes at: the child compiles each program at the sampler's size and
    the decode program at a few more (`compiled`), a run at every size it meets, and each leaves tens of MB."""
    base = (measured.get("sampler_compile") or {}).get("peak", 0)
    decode = sampler.get("decode_compile") or {}
    more = sampler["decode_variants"][who] - 1 - decode.get("compiled", 0)
    return base + decode.get("retained", 0) * max(0, more)


def trainer_estimate(cfg: RunConfig, doc: dict, measured: dict) -> dict:
    report = doc["trainer"]
    devices = report["devices"] // cfg.trainer.processes
    compiled = (measured.get("trainer_compile") or {}).get("peak", 0)
    parts, notes = common_parts(report, measured, "trainer", devices, compiled)
    sizes = report["per_device_bytes"]
    state = sizes["parameters"] + sizes["optimizer_state"] + sizes["reference_parameters"]
    parts["checkpoint_copy"] = state * devices
    rows = evaluation_rows(cfg)
    if rows and "sampler" in doc:
        # its decode layout and KV cache on the trainer's devices are in `devices` (plan/evaluation.py): the compile
        parts["evaluation_engine"] = engine_compile(doc["sampler"], measured, "evaluation")
    elif rows:
        notes.append(f"the evaluation engine's compile is not counted: sampler.engine={cfg.sampler.engine} compiles "
                     "no JAX engine in the plan")
    if transport_spec(cfg.weights.transport).in_process:
        notes.append("weights.transport=local: one process holds the trainer and the samplers; add the samplers' "
                     "devices figure to this one")
    return {"parts": parts, "total": sum(parts.values()), "devices": devices, "evaluation_rows": rows,
            "notes": notes}


def sampler_estimate(cfg: RunConfig, report: dict, measured: dict) -> dict:
    devices = report["devices"]
    parts, notes = common_parts(report, measured, "sampler", devices, engine_compile(report, measured, "sampler"))
    return {"parts": parts, "total": sum(parts.values()), "devices": devices, "notes": notes}


def evaluation_rows(cfg: RunConfig) -> int:
    """Rows the trainer's held-out evaluation decodes at once (0: it never evaluates, nor checks the final weights'
    greedy outputs, weights.verify_prompts): eval.batch_size episodes in flight, or one group of eval.samples when
    that is more (common/episodes/evaluation.py, finite.py), at most generation.decode_slots."""
    t, e = cfg.trainer, cfg.eval
    if not (t.eval_before or t.eval_after or e.every_steps or cfg.weights.verify_prompts):
        return 0
    return min(cfg.generation.decode_slots, max(e.batch_size, e.samples))


def host_fit(cfg: RunConfig, estimates: dict[str, dict], usable: int) -> dict:
    """The run's processes on one machine: trainer.processes trainers and sampler.replicas samplers together."""
    trainer = estimates.get("trainer", {}).get("total", 0) * cfg.trainer.processes
    samplers = estimates.get("sampler", {}).get("total", 0) * cfg.sampler.replicas
    return {"total_bytes": trainer + samplers, "usable_bytes": usable, "fits": trainer + samplers <= usable}


def host_lines(role: str, estimate: dict, gib) -> list[str]:
    """The report's lines for one role's estimate."""
    lines = [f"  on the CPU, the {role} process's expected peak resident memory (docs/plan.md):"]
    for name, n in estimate["parts"].items():
        what = PARTS[name].format(devices=estimate["devices"], rows=estimate.get("evaluation_rows"))
        lines.append(f"    {name:<26} {gib(n):>14}  {what}")
    lines.append(f"    {'expected peak':<26} {gib(estimate['total']):>14}")
    lines.extend(f"    note: {note}" for note in estimate["notes"])
    return lines
