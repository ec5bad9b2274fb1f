"""Benchmark: wall time of the same RL steps, asynchronous against synchronous.

Both modes run the real system with `grpo-stream up` (embedded Redis, trainer
and two sampler processes) on the demo config, RL only (no warm start, no
evaluation), with the same steps, batch and model:

  async  the demo's setting: samplers generate without waiting and the trainer
         takes groups up to trainer.max_staleness=4 versions old.
  sync   generate, then train: each sampler makes groups_per_step / replicas
         groups with one version and waits for the next
         (sampler.max_groups_per_version), and the trainer takes only groups of
         the version it holds (trainer.max_staleness=0).

The figure compared is the steady-state wall time per step: from the end of
step WARMUP_STEPS to the end of the last step, per step (the trainer's
metrics timestamps). The first steps are left out because both modes spend
them identically compiling the train step and waiting for the samplers' first
compiled batch; `rl_seconds` (summary.json, first version to last step,
start-up included) is reported too, as `async_over_sync_total`. Modes
alternate, `repeats` times each, and the medians are compared. Both poll for
weights every 20 ms so the synchronous hand-off is not penalised by the poll
interval.

Overlap cannot beat its bound: a synchronous step is the trainer's own work T (every phase of its step but
waiting for data) plus generation and hand-off G, an asynchronous one at best max(T, G), so
`async_over_sync_bound` = max(T, G) / (T + G), from the synchronous runs, is reported next to the ratio (with
`generation_share_sync` = G / (T + G)). How close the ratio gets to its bound is what the overlap machinery
(buffer, admission, weight hand-off) decides; the bound itself is set by the workload and the engine's speed.

The buffer holds two steps' worth of groups (buffer.max_groups = 2 x
groups_per_step) in both modes. With one step's worth (the demo's 16) the
ingest keeps refusing the samplers' run-ahead groups, which wait out
retry_after_ms in the samplers' backlogs and age past max_staleness, so the
asynchronous trainer waits about 0.13 s of its 0.41 s step for fresh data:
measured async/sync 0.94 with 16, 0.72 with 32.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from grpo_stream.reports.run_report import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_arith.yaml"
REPLICAS, GROUPS_PER_STEP = 2, 16
WARMUP_STEPS = 3


def _common(steps: int) -> list[str]:
    return ["warmstart.steps=0", "trainer.eval_before=false", "trainer.eval_after=false", f"trainer.steps={steps}",
            f"sampler.replicas={REPLICAS}", f"trainer.groups_per_step={GROUPS_PER_STEP}", "sampler.weight_poll_s=0.02",
            "trainer.metrics_port=null", "sampler.metrics_port=null", "trainer.final_wait_s=20",
            f"buffer.max_groups={2 * GROUPS_PER_STEP}"]


def mode_overrides(mode: str, groups_per_step: int, replicas: int, async_staleness: int = 4) -> list[str]:
    """The config overrides of one mode: `async` lets the trainer take groups up to `async_staleness` versions old;
    `sync` makes each sampler generate its share of a step with one version and wait for the next, and the trainer
    take only groups of the version it holds (scripts/gpu-check.sh runs both modes on a GPU)."""
    if mode == "async":
        return [f"trainer.max_staleness={async_staleness}"]
    return ["trainer.max_staleness=0", f"sampler.max_groups_per_version={groups_per_step // replicas}"]


MODES = {mode: mode_overrides(mode, GROUPS_PER_STEP, REPLICAS) for mode in ("async", "sync")}


def _pinning() -> list[str]:
    """Trainer on the first core, samplers on the others: separate devices, as in a real deployment."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise RuntimeError("the pinned comparison needs at least 2 CPU cores")
    return [f"trainer.cpu_affinity=[{cores[0]}]", f"sampler.cpu_affinity=[{','.join(map(str, cores[1:]))}]"]


def run_mode(mode: str, steps: int, run_dir: pathlib.Path, pinned: bool) -> dict:
    """One `grpo-stream up` run; returns the summary figures that matter here."""
    cmd = [sys.executable, "-m", "grpo_stream", "up", "--config", str(CONFIG), "--run-dir", str(run_dir),
           *_common(steps), *MODES[mode], *(_pinning() if pinned else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"{mode} run failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
    summary = json.loads(summary_path.read_text())
    if summary["steps"] != steps:
        raise RuntimeError(f"{mode} run stopped after {summary['steps']} of {steps} steps")
    rows = step_rows(run_dir)
    if len(rows) != steps:
        raise RuntimeError(f"{mode} run logged {len(rows)} step rows for {steps} steps")
    return {"rl_seconds": summary["rl_seconds"], **step_figures(rows),
            "groups_dropped_stale": summary["groups_dropped_stale"],
            "groups_generated": summary["groups_generated"],
            "generation_wasted_fraction": summary["generation_wasted_fraction"]}


def step_rows(run_dir: pathlib.Path) -> list[dict]:
    """The trainer's per-step rows of metrics-trainer.jsonl (one per RL step; none when there is no file). A line
    that is not whole JSON is skipped (read_metrics): a trainer killed mid-write (gpu-check stops runs at their cap)
    leaves one torn, and one torn line must not lose the run's figures. A resumed trainer logs again the steps after
    its checkpoint: a step logged at or below the last one kept rolls back the rows from that step on (as
    run_report.latest_timeline does), so each step counts once, from the final timeline."""
    path = run_dir / "metrics-trainer.jsonl"
    rows: list[dict] = []
    for row in read_metrics(path) if path.exists() else []:
        if "train/staleness_mean" in row:
            while rows and rows[-1]["step"] >= row["step"]:
                rows.pop()
            rows.append(row)
    return rows


def step_figures(rows: list[dict], warmup: int = WARMUP_STEPS) -> dict:
    """Steady-state figures of a run's step rows (more than `warmup` of them): wall time per step from the end of
    step `warmup` on, and the medians of the trainer's phases over those steps."""
    times, steady_rows = [r["time"] for r in rows], rows[warmup:]
    steady = (times[-1] - times[warmup - 1]) / (len(times) - warmup)
    compute = statistics.median(r["train/compute_seconds"] for r in steady_rows)
    wait = statistics.median(r["train/wait_seconds"] for r in steady_rows)
    # the trainer's own work per step: every phase but waiting for data (batching, publication, the update)
    busy = statistics.median(r["train/step_seconds"] - r["train/wait_seconds"] for r in steady_rows)
    return {"steady_seconds_per_step": round(steady, 4), "trainer_compute_seconds": round(compute, 4),
            "trainer_wait_seconds": round(wait, 4), "trainer_busy_seconds": round(busy, 4),
            "staleness_mean": round(sum(r["train/staleness_mean"] for r in rows) / len(rows), 3),
            "staleness_max": max(int(r["train/staleness_max"]) for r in rows)}


def overlap_bound(sync_steady: float, sync_busy: float) -> dict:
    """What overlap can give at best, from a synchronous run: its step is the trainer's own work T (`sync_busy`: the
    update, batching, publication, every phase but waiting for data) plus the rest G (generation and hand-off); run
    side by side on their own devices the step can shrink to max(T, G), no further. Returns the bound max(T, G) /
    (T + G) and G's share of the synchronous step."""
    other = max(sync_steady - sync_busy, 0.0)
    return {"async_over_sync_bound": round(max(sync_busy, other) / sync_steady, 3),
            "generation_share_sync": round(other / sync_steady, 3)}


def run(quick: bool = False) -> dict:
    steps, repeats = (6, 1) if quick else (60, 2)
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="grpo-stream-bench-") as tmp:
        for k in range(repeats):
            for mode in ("sync", "async"):
                runs[mode].append(run_mode(mode, steps, pathlib.Path(tmp) / f"{mode}-{k}", pinned=True))
    median = {mode: statistics.median(r["rl_seconds"] for r in rs) for mode, rs in runs.items()}
    steady = {mode: statistics.median(r["steady_seconds_per_step"] for r in rs) for mode, rs in runs.items()}
    # what overlap can give at best (overlap_bound), from the synchronous runs' trainer work
    bound = overlap_bound(steady["sync"], statistics.median(r["trainer_busy_seconds"] for r in runs["sync"]))
    if any(r["staleness_max"] for r in runs["sync"]):
        raise RuntimeError(f"synchronous mode trained on stale groups: {runs['sync']}")
    return {
        "benchmark": "async", "quick": quick, "config": str(CONFIG.relative_to(ROOT)), "steps": steps,
        "repeats": repeats, "sampler_replicas": REPLICAS, "groups_per_step": GROUPS_PER_STEP,
        "rl_seconds": {mode: round(v, 2) for mode, v in median.items()},
        "warmup_steps": WARMUP_STEPS, "buffer_max_groups": 2 * GROUPS_PER_STEP,
        "steady_seconds_per_step": {mode: round(v, 4) for mode, v in steady.items()},
        "async_over_sync": round(steady["async"] / steady["sync"], 3),
        "async_over_sync_total": round(median["async"] / median["sync"], 3),
        **bound,
        # groups generated for training but never trained (admission control keeps it near 0 in both modes)
        "generation_wasted_fraction": {mode: max(r["generation_wasted_fraction"] for r in rs)
                                       for mode, rs in runs.items()},
        "runs": runs,
    }
