"""How much a run's learning figures vary from run to run, and the test thresholds that follows from it.

A learning check in the test suite (the CPU demo must raise held-out accuracy) is a statistical test on one
run, and the samplers' timing changes the data from run to run. Its threshold is set here, from repeated runs
of the same command, so the chance that a healthy run fails the check is known:

    python -m grpo_stream.bench.learning_spread demo --runs 10 --out tests/e2e/calibration/demo.json --keep-warmstart W
    python -m grpo_stream.bench.learning_spread gspo --runs 10 --out tests/e2e/calibration/gspo.json --warmstart W
    python -m grpo_stream.bench.learning_spread gspo-100 --runs 10 --warmstart W
    python -m grpo_stream.bench.learning_spread gspo-100 --runs 10 --warmstart-seeds 1
    python -m grpo_stream.bench.learning_spread tools --runs 10 --out tests/e2e/calibration/multi-turn-tools.json
    python -m grpo_stream.bench.learning_spread distill --runs 10 --out tests/e2e/calibration/distill.json
    python -m grpo_stream.bench.learning_spread distill-rl --runs 3 --out tests/e2e/calibration/distill-rl.json
    python -m grpo_stream.bench.learning_spread smollm2 --runs 10 --out tests/e2e/calibration/smollm2-arith.json

Without --out the runs go to runs/learning-spread/SETUP.json (gspo and gspo-100 need --warmstart, a demo run's
warm-started model, which `demo --keep-warmstart W` keeps, or --warmstart-seeds). distill and distill-rl start from
the kept warm start (tests/data/gspo-warmstart) and compare with the kept teacher (tests/data/distill-teacher).

For each figure the threshold is the one-sided 99% lower prediction bound for one new run,
mean - t(0.99, n-1) * sd * sqrt(1 + 1/n), with the run-to-run standard deviation sd of the n runs: if the figure is
normally distributed, a healthy run falls below it with probability 1% (t = 2.821 for n = 10). The bound is
never above the lowest run seen. A run's figures are taken from its summary.json, nothing else.

`--warmstart-seeds S` (gspo, gspo-100): each run first makes its own warm start with `run.seed=S+k` (the demo's
warm start, exported, one RL step, no evaluation) and starts from it with the same seed. A bar calibrated on one warm
start measures the RL run's noise only; the warm start a CI machine makes differs from this machine's (other seeds,
or the same seed on another CPU's floating-point reductions), and how much a run gains depends on where it starts.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from grpo_stream.common.runtime.files import write_atomic
from grpo_stream.reports.run_report import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The runs the test suite checks (tests/e2e/test_demo.py): the shipped demo (which also exports its warm-started
# model), and the shorter GSPO run from that warm start, with two optimizer steps per batch so the importance ratio
# of the second is not 1 and GSPO's sequence-level ratio differs from GRPO's token ratios.
SETUPS = {
    "demo": ["--config", "configs/tiny_arith.yaml", "warmstart.export=true"],
    "gspo": ["--config", "configs/tiny_arith.yaml", "model.kind=hf", "model.path={warmstart}", "warmstart.steps=0",
             "algo.loss_algo=gspo-token", "algo.minibatches=2", "trainer.steps=400"],
    # the default lane's shorter GSPO check (tests/e2e/test_demo.py, GSPO_SHORT_STEPS)
    "gspo-100": ["--config", "configs/tiny_arith.yaml", "model.kind=hf", "model.path={warmstart}",
                 "warmstart.steps=0", "algo.loss_algo=gspo-token", "algo.minibatches=2", "trainer.steps=100"],
    # the default lane's GSPO check since 2026-11-30 (tests/e2e/test_gspo_learning.py, GSPO_SHORT_STEPS)
    "gspo-24": ["--config", "configs/tiny_arith.yaml", "model.kind=hf", "model.path={warmstart}",
                "warmstart.steps=0", "algo.loss_algo=gspo-token", "algo.minibatches=2", "trainer.steps=24"],
    # a warm start alone (exported, one RL step, no evaluation): what --warmstart-seeds starts each run from
    "warmstart": ["--config", "configs/tiny_arith.yaml", "warmstart.export=true", "trainer.steps=1",
                  "trainer.eval_before=false", "trainer.eval_after=false"],
    # the multi-turn demo: tool calls and the environment's answers (issue 45; tests/e2e/test_multi_turn_demo.py)
    "tools": ["--config", "configs/tiny_arith_tools.yaml"],
    # on-policy distillation's headline (issue 59; tests/e2e/test_distill_learning.py): the kept warm start distilled
    # from the demo's RL-trained model (tests/data/distill-teacher) alone, held-out greedy accuracy every 25 steps
    "distill": ["--config", "configs/distill_arith.yaml", "model.path={warmstart}", "distill.teacher={teacher}",
                "trainer.steps=200", "eval.every_steps=25", "eval.samples=0", "eval.ks=[1]"],
    # against RL alone from the same start, as long as the teacher's own RL run
    "distill-rl": ["--config", "configs/tiny_arith.yaml", "model.kind=hf", "model.path={warmstart}",
                   "warmstart.steps=0", "eval.every_steps=25", "eval.samples=0", "eval.ks=[1]"],
    # the real pretrained model's CPU demo (issue 58; tests/e2e/test_smollm2_learning.py), as shipped; its model
    # directory built first with `grpo-stream fixture smollm2`
    "smollm2": ["--config", "configs/smollm2_arith.yaml"],
}
KL_WINDOW = 10  # steps averaged at each end of a distillation run for its KL ratio
# what the distillation setups start from and distil: kept in the tree
DATA = ROOT / "tests" / "data"
DISTILL_DEFAULTS = {"warmstart": DATA / "gspo-warmstart", "teacher": DATA / "distill-teacher"}

# one-sided 99% quantile of Student's t with n - 1 degrees of freedom
_T99 = {2: 31.821, 3: 6.965, 4: 4.541, 5: 3.747, 6: 3.365, 7: 3.143, 8: 2.998, 9: 2.896, 10: 2.821, 11: 2.764,
        12: 2.718, 13: 2.681, 14: 2.650, 15: 2.624, 16: 2.602, 17: 2.583, 18: 2.567, 19: 2.552, 20: 2.539}


def figures(summary: dict) -> dict[str, float]:
    """The learning figures of one run: held-out gains (sampled pass@1, greedy accuracy, greedy reward by the run's
    task.rewards), and its wall time; with an evaluation curve (eval.every_steps), its greedy accuracies by step."""
    before, after = summary["eval_before"], summary["eval_after"]
    out = {"greedy_gain": after["accuracy"] - before["accuracy"], "greedy_after": after["accuracy"],
           "wall_seconds": summary["wall_seconds"]}
    if "reward" in before and "reward" in after:  # greedy, scored by the run's task.rewards (what its check reads)
        out.update(reward_gain=after["reward"] - before["reward"], reward_before=before["reward"],
                   reward_after=after["reward"])
    if "1" in (before.get("pass_at_k") or {}):
        out.update(sampled_pass1_gain=after["pass_at_k"]["1"] - before["pass_at_k"]["1"],
                   sampled_pass1_before=before["pass_at_k"]["1"], sampled_pass1_after=after["pass_at_k"]["1"])
    if summary.get("eval_curve"):
        out["greedy_curve"] = {str(row["step"]): row["accuracy"] for row in summary["eval_curve"]}
    return out


def steps_to_reach(curve: dict[str, float], target: float) -> int | None:
    """The first evaluated step whose greedy accuracy is at least `target` (None: none reached it)."""
    reached = [int(step) for step, accuracy in curve.items() if accuracy >= target]
    return min(reached) if reached else None


def teacher_accuracy(teacher: pathlib.Path) -> float:
    """The held-out greedy accuracy a kept teacher scored in its own run (its eval.json, written when it was kept)."""
    return json.loads((teacher / "eval.json").read_text())["accuracy"]


_Z99 = 2.3263478740408408  # the standard normal's 99% quantile


def t99(df: int) -> float:
    """Student's t 99% quantile with `df` degrees of freedom, by the Cornish-Fisher expansion in 1/df to the fourth
    order (Abramowitz & Stegun 26.7.5): within 2e-6 of the exact quantile from df = 20 on (scipy is not a dependency
    of grpo-stream, so it is computed here); `_T99` holds the exact values below that, where the series drifts."""
    z, v = _Z99, float(df)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / v + g2 / v ** 2 + g3 / v ** 3 + g4 / v ** 4


def lower_bound(values: list[float]) -> dict[str, float]:
    """mean, sd, min and the 99% one-sided lower prediction bound for one more run (see the module doc)."""
    n = len(values)
    if n < 2:
        raise ValueError(f"need at least 2 runs for a spread, got {n}: raise --runs")
    mean, sd = statistics.mean(values), statistics.stdev(values)
    t = _T99.get(n) or t99(n - 1)
    bound = min(mean - t * sd * math.sqrt(1 + 1 / n), min(values))
    return {"n": n, "mean": round(mean, 4), "sd": round(sd, 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "bound_99": round(bound, 4)}


def _up(setup: str, run_dir: pathlib.Path, timeout: int, warmstart: pathlib.Path | None,
        extra: list[str]) -> None:
    args = [a.format(warmstart=warmstart, teacher=DISTILL_DEFAULTS["teacher"]) for a in SETUPS[setup]] + extra
    cmd = [sys.executable, "-m", "grpo_stream", "up", "--run-dir", str(run_dir), *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")


def run_once(setup: str, run_dir: pathlib.Path, timeout: int, warmstart: pathlib.Path | None,
             seed: int | None = None) -> dict:
    """One run's figures; with `seed`, its own warm start made first with that seed (gspo setups)."""
    extra = [] if seed is None else [f"run.seed={seed}"]
    if seed is not None and setup.startswith("gspo"):
        warmstart = run_dir.parent / "warmstart"
        _up("warmstart", warmstart, timeout, None, extra)
        warmstart = warmstart / "warmstart-model"
    _up(setup, run_dir, timeout, warmstart, extra)
    summary = json.loads((run_dir / "summary.json").read_text())
    out = figures(summary)
    if seed is not None:
        out.update(seed=seed, greedy_before=summary["eval_before"]["accuracy"])
    # how off-policy the run was (the load of the machine sets it): mean staleness and per-group ESS over its steps
    rows = [r for r in read_metrics(run_dir / "metrics-trainer.jsonl") if "train/loss" in r]  # torn lines skipped
    for key in ("staleness_mean", "is_ess_group_mean", "mismatch_kl_k3"):
        values = [r[f"train/{key}"] for r in rows if f"train/{key}" in r]
        if values:
            out[key] = round(statistics.mean(values), 4)
    kl = [r["train/distill_kl"] for r in rows if "train/distill_kl" in r]
    if len(kl) >= 2 * KL_WINDOW:
        out["distill_kl_ratio"] = round(kl_ratio(kl), 4)
    return out


def kl_ratio(kl: list[float]) -> float:
    """How far a distillation run's KL to the teacher fell: the last KL_WINDOW steps' mean over the first's."""
    return statistics.mean(kl[-KL_WINDOW:]) / statistics.mean(kl[:KL_WINDOW])


def spread(runs: list[dict], setup: str) -> dict:
    """The bounds of a setup's figures over its runs; for the distillation setups, against the kept teacher's greedy
    accuracy: the final gap to it (`greedy_after - teacher`), the KL ratio's upper bound, and the steps each run took
    to come within 0, 0.02 and 0.05 of it."""
    if len(runs) < 2:
        return {}
    keys = [k for k in ("sampled_pass1_gain", "greedy_gain", "reward_gain") if all(k in r for r in runs)]
    out = {key: lower_bound([r[key] for r in runs]) for key in keys}
    if setup.startswith("distill"):
        teacher = teacher_accuracy(DISTILL_DEFAULTS["teacher"])
        out["teacher_accuracy"] = teacher
        out["gap_to_teacher"] = lower_bound([r["greedy_after"] - teacher for r in runs])
        if all("distill_kl_ratio" in r for r in runs):  # an upper bound: -(lower bound of the negated ratios)
            low = lower_bound([-r["distill_kl_ratio"] for r in runs])
            out["distill_kl_ratio"] = {"mean": -low["mean"], "sd": low["sd"], "max": -low["min"],
                                       "bound_99_upper": -low["bound_99"]}
        for gap in (0.0, 0.02, 0.05):
            out[f"steps_to_teacher_within_{gap}"] = [steps_to_reach(r.get("greedy_curve", {}), teacher - gap)
                                                      for r in runs]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("setup", choices=sorted(SETUPS))
    p.add_argument("--runs", type=int, default=10, help="runs to make (at least 10 for a test threshold)")
    p.add_argument("--out", type=pathlib.Path, help="JSON file; runs already in it are kept (default "
                   "runs/learning-spread/SETUP.json)")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    p.add_argument("--keep-warmstart", type=pathlib.Path, help="demo: copy the first run's warm-started model here")
    p.add_argument("--warmstart", type=pathlib.Path, help="gspo: the warm-started model to start from (a demo "
                   "run's RUN_DIR/warmstart-model, e.g. from --keep-warmstart)")
    p.add_argument("--warmstart-seeds", type=int, metavar="S", help="gspo: each run k makes its own warm start with "
                   "run.seed=S+k and runs with that seed (calibrates over warm starts, not one)")
    args = p.parse_args(argv)
    args.out = args.out or ROOT / "runs" / "learning-spread" / f"{args.setup}.json"
    if args.setup.startswith("gspo") and args.warmstart_seeds is None and not (
            args.warmstart and (args.warmstart / "config.json").is_file()):
        raise SystemExit("gspo starts from a demo run's warm start: pass --warmstart DIR (made by "
                         "`demo --keep-warmstart DIR`), or --warmstart-seeds S")
    if args.setup.startswith("distill"):
        args.warmstart = args.warmstart or DISTILL_DEFAULTS["warmstart"]
    doc = json.loads(args.out.read_text()) if args.out.exists() else {"setup": args.setup, "runs": []}
    if doc.get("setup") != args.setup:
        raise SystemExit(f"{args.out} holds runs of '{doc.get('setup')}', not '{args.setup}': pick another --out")
    doc["command"] = "grpo-stream up " + " ".join(SETUPS[args.setup]).replace("{warmstart}", "WARMSTART")
    if args.warmstart_seeds is not None:
        doc["command"] += " run.seed=SEED (WARMSTART: grpo-stream up " + " ".join(SETUPS["warmstart"]) + \
            " run.seed=SEED)"
    for k in range(args.runs):
        with tempfile.TemporaryDirectory(prefix=f"spread-{args.setup}-") as tmp:
            started = time.time()
            seed = None if args.warmstart_seeds is None else args.warmstart_seeds + len(doc["runs"])
            run = run_once(args.setup, pathlib.Path(tmp) / "run", args.timeout, args.warmstart, seed)
            if args.keep_warmstart and not args.keep_warmstart.exists():
                shutil.copytree(pathlib.Path(tmp) / "run" / "warmstart-model", args.keep_warmstart)
        run["date_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime(started))
        doc["runs"].append(run)
        print(f"{args.setup} run {k + 1}/{args.runs}: " + ", ".join(f"{key} {v:.3f}" if isinstance(v, float) else
                                                                     f"{key} {v}" for key, v in run.items()),
              flush=True)
        doc["spread"] = spread(doc["runs"], args.setup)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        # after every run, and whole or not at all: the file holds every earlier run (hours of them), which a kill or
        # a full disk in the middle of an in-place rewrite would lose
        write_atomic(args.out, json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["spread"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
