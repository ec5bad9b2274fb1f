"""What `scripts/gpu-check.sh` reads from one `grpo-stream up` run directory, and the checks it makes of them.

Per run: steps and steps/s (steady state, after bench/async_vs_sync.py's warm-up steps), the trainer's compute
against its wait for data (medians of its per-step phases), each sampler's tokens/s, the weight hand-off per
version (the trainer's publication to the sampler's installation, and the fetch's GB/s), each process's peak device
memory against `grpo-stream plan`'s figure, and the samplers' logprob agreement with the trainer at lag 0.
"""

from __future__ import annotations

import json
import pathlib
import statistics

from grpo_stream.bench.async_vs_sync import WARMUP_STEPS, overlap_bound, step_figures, step_rows


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _read(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sampler_figures(doc: dict) -> dict:
    """One sampler's sampler-<index>.json as rates: tokens/s while generating and over its run, and the weight
    hand-off of every version it installed after its first (the first waits for the sampler's own start)."""
    tokens, running = doc.get("tokens_generated", 0), doc.get("sampling_seconds")
    # while generating, less the engine thread's compiles: the engine alone is timed after a run that compiled; the
    # tokens its engine made in that time (rows cancelled when the run ended too, which no group sent holds), as the
    # engine alone is credited with every token it makes; the tokens sent where the engine keeps no count (vLLM)
    generating = (doc.get("generate_seconds") or 0) - (doc.get("compile_seconds") or 0)
    decoded = doc.get("engine_tokens_decoded")
    made = decoded if decoded is not None else tokens
    seconds, sizes = doc.get("fetch_seconds", [])[1:], doc.get("fetch_bytes", [])[1:]
    gbps = [n / s / 1e9 for n, s in zip(sizes, seconds) if s > 0]
    latency = doc.get("publish_to_install_seconds", [])[1:]
    return {"groups": doc.get("groups"), "tokens_generated": tokens,
            "engine_tokens_decoded": decoded,
            "tokens_per_second_generating": round(made / generating, 1) if generating > 0 else None,
            "compile_seconds": doc.get("compile_seconds"),
            "tokens_per_second": round(tokens / running, 1) if running else None,
            "waited_for_weights_s": doc.get("waited_for_weights_s"),
            "waited_for_admission_s": doc.get("waited_for_admission_s"),
            "rows_in_flight": doc.get("rows_in_flight"),
            "engine_rows_decoding_mean": doc.get("engine_rows_decoding_mean"),
            "versions_installed": len(doc.get("versions", [])),
            "weight_bytes_per_version": sizes[-1] if sizes else None,
            "publish_to_install_seconds_median": _median(latency),
            "publish_to_install_seconds_max": round(max(latency), 4) if latency else None,
            "fetch_gb_per_s_median": _median(gbps), "fetch_gb_per_s_min": round(min(gbps), 3) if gbps else None,
            "per_version": [{"version": v, "publish_to_install_s": p, "fetch_s": s, "gb_per_s": round(n / s / 1e9, 3)
                             if s > 0 else None} for v, p, s, n in zip(doc.get("versions", [])[1:], latency, seconds,
                                                                       sizes)],
            "device_memory": doc.get("device_memory")}


def _over(measured: dict | None, planned: int | None) -> float | None:
    peak = (measured or {}).get("peak_bytes_in_use")
    return round(peak / planned, 3) if peak and planned else None


def memory_figures(summary: dict, samplers: dict, plan: dict | None, colocated: bool) -> dict:
    """Peak device memory per process against `plan`'s per-device totals (one process holds both roles when
    colocated)."""
    planned = {role: ((plan or {}).get(role) or {}).get("per_device_bytes", {}).get("total")
               for role in ("trainer", "sampler")}
    out = {"trainer": summary.get("device_memory"), "plan_trainer_bytes": planned["trainer"],
           "plan_sampler_bytes": planned["sampler"]}
    if colocated:
        both = planned["trainer"] + len(samplers) * planned["sampler"] if all(planned.values()) else None
        out["peak_over_plan"] = _over(out["trainer"], both)
        return out
    out["trainer_peak_over_plan"] = _over(out["trainer"], planned["trainer"])
    out["samplers"] = {name: {"device_memory": s["device_memory"],
                              "peak_over_plan": _over(s["device_memory"], planned["sampler"])}
                       for name, s in samplers.items()}
    return out


def run_figures(run_dir: pathlib.Path, steps_asked: int, plan: dict | None = None, colocated: bool = False) -> dict:
    """The figures of one run, from what its processes left in `run_dir` (a run stopped early included)."""
    summary = _read(run_dir / "summary.json") or {}
    rows = step_rows(run_dir)
    out: dict = {"steps": len(rows), "steps_asked": steps_asked, "rl_seconds": summary.get("rl_seconds"),
                 "wall_seconds": summary.get("wall_seconds")}
    if len(rows) > WARMUP_STEPS:
        steady = step_figures(rows)
        out.update(steady, steps_per_second=round(1 / steady["steady_seconds_per_step"], 4),
                   trainer_compute_share=round(steady["trainer_compute_seconds"] / steady["steady_seconds_per_step"], 3),
                   trainer_wait_share=round(steady["trainer_wait_seconds"] / steady["steady_seconds_per_step"], 3))
    samplers = {path.stem: sampler_figures(doc) for path in sorted(run_dir.glob("sampler-*.json"))
                if (doc := _read(path)) is not None}
    out["samplers"] = samplers
    out["sampler_tokens_per_second"] = sum(s["tokens_per_second"] or 0 for s in samplers.values()) or None
    out["weights"] = {"transport": summary.get("weight_transport"),
                      "versions_published": summary.get("weight_versions_published"),
                      "publish_seconds_mean": summary.get("weight_publish_seconds_mean"),
                      "publish_to_install_seconds_median": _median(
                          [p["publish_to_install_s"] for s in samplers.values() for p in s["per_version"]]),
                      "fetch_gb_per_s_median": _median(
                          [p["gb_per_s"] for s in samplers.values() for p in s["per_version"] if p["gb_per_s"]])}
    out["memory"] = memory_figures(summary, samplers, plan, colocated)
    out["logprob_agreement_lag0"] = summary.get("logprob_agreement_lag0")
    out["groups"] = {k: summary.get(k) for k in ("groups_generated", "groups_trained", "groups_dropped_stale",
                                                 "generation_wasted_fraction")}
    return out


def comparison(asynchronous: dict, synchronous: dict, colocated: dict | None, engine: dict | None = None) -> dict:
    """Async over sync steady wall time per step, beside what overlap can give at best (bench/async_vs_sync.py's
    bound, from the synchronous run's trainer work); the one-process run against the asynchronous one; and each
    run's sampler against its engine alone on the same device (`engine_figures`)."""
    out = engine_figures(engine, {"async": asynchronous, "sync": synchronous})
    if "steady_seconds_per_step" not in asynchronous or "steady_seconds_per_step" not in synchronous:
        return {"skipped": "a run has too few steps", **out}
    out.update(async_over_sync=round(asynchronous["steady_seconds_per_step"]
                                     / synchronous["steady_seconds_per_step"], 3),
               **overlap_bound(synchronous["steady_seconds_per_step"], synchronous["trainer_busy_seconds"]))
    if colocated and "steady_seconds_per_step" in colocated:
        out["colocated_over_async"] = round(colocated["steady_seconds_per_step"]
                                            / asynchronous["steady_seconds_per_step"], 3)
    return out


def engine_figures(engine: dict | None, runs: dict[str, dict]) -> dict:
    """The engine alone (`bench gpu engine`'s JSON with gpu-check's `sync_admitted_rows`, or None): kept full, and
    holding the rows the synchronous run's admission allows; each run's samplers' tokens/s while generating over it
    (their mean, one engine each): `sampler_over_engine_<run>` (issue 55's goal >= 0.8), and for the synchronous run
    also against the engine at its own admitted rows (what the stream loses beyond admission's bound). Beside them
    the rows the samplers' engines decoded per step."""
    loads, held = (engine or {}).get("loads") or {}, (engine or {}).get("sync_admitted_rows")
    # by rows, not by order: the admitted rows are timed first (engine.py), the full load after them
    rate = (loads.get(str(engine.get("rows"))) or {}).get("tokens_per_second") if engine else None
    at_held = (loads.get(str(held)) or {}).get("tokens_per_second")
    if not rate and not at_held:
        return {}
    out = {"engine_rows": engine.get("rows"), "engine_tokens_per_second": rate, "sync_admitted_rows": held,
           "engine_tokens_per_second_sync_admitted_rows": at_held}
    for name, run in runs.items():
        samplers = (run or {}).get("samplers") or {}
        generating = [s["tokens_per_second_generating"] for s in samplers.values() if s["tokens_per_second_generating"]]
        rows = [s["engine_rows_decoding_mean"] for s in samplers.values() if s.get("engine_rows_decoding_mean")]
        if generating and rate:
            out[f"sampler_over_engine_{name}"] = round(statistics.mean(generating) / rate, 3)
        if generating:
            out[f"sampler_rows_decoding_mean_{name}"] = round(statistics.mean(rows), 1) if rows else None
            if name == "sync" and at_held:
                out["sampler_over_engine_sync_same_rows"] = round(statistics.mean(generating) / at_held, 3)
    return out


# every figure a run must have (None allowed where the backend has none: device memory on the CPU)
RUN_FIGURES = ("steady_seconds_per_step", "steps_per_second", "trainer_compute_seconds", "trainer_wait_seconds",
               "sampler_tokens_per_second", "logprob_agreement_lag0")
WEIGHT_FIGURES = ("publish_to_install_seconds_median", "fetch_gb_per_s_median")
ENGINE_FIGURES = ("engine_tokens_per_second", "sampler_over_engine_async", "sampler_over_engine_sync",
                  "sampler_over_engine_sync_same_rows")


def missing_figures(phases: dict, device_memory: bool, optional: tuple[str, ...] = ()) -> list[str]:
    """'phase.figure' for every figure a phase lacks (`device_memory`: peaks must be there too). Phases named in
    `optional` ("engine", "colocated", "plan": run if time remains) may be skipped for the deadline."""
    missing = []
    for name in ("demo", "async", "sync", "colocated"):
        run = (phases.get(name) or {}).get("figures")
        if name in optional and (phases.get(name) or {}).get("reason") == "deadline":
            continue
        if run is None:
            missing.append(f"{name}: no figures ({(phases.get(name) or {}).get('status', 'not run')})")
            continue
        missing += [f"{name}.{key}" for key in RUN_FIGURES if run.get(key) is None]
        missing += [f"{name}.weights.{key}" for key in WEIGHT_FIGURES if run["weights"].get(key) is None]
        if device_memory:
            missing += [f"{name}.memory.trainer"] * (run["memory"].get("trainer") is None)
            missing += [f"{name}.memory.samplers.{s}" for s, m in run["memory"].get("samplers", {}).items()
                        if m["device_memory"] is None]
    plan = phases.get("plan") or {}
    if not ("plan" in optional and plan.get("status") in ("stopped", "skipped")):
        missing += [f"plan.{key}" for key in ("trainer_bytes", "sampler_bytes") if plan.get(key) is None]
    compared = phases.get("comparison") or {}
    missing += [f"comparison.{key}" for key in ("async_over_sync", "async_over_sync_bound") if compared.get(key) is None]
    engine = phases.get("engine") or {}
    if not ("engine" in optional and engine.get("reason") == "deadline"):
        missing += [f"comparison.{key}" for key in ENGINE_FIGURES if compared.get(key) is None]
    demo = phases.get("demo") or {}
    missing += ["demo.learning.gain_points"] * ((demo.get("learning") or {}).get("gain_points") is None)
    return missing
