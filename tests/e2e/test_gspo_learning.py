"""GSPO under `up`, where its objective differs from GRPO's: two optimizer steps per batch (minibatches=2), so the
importance ratio of the second is not 1 and GSPO's sequence-level ratio (against the sampler's policy, GSPO's own
clip 3e-4 / 4e-4) acts. The default lane runs 24 steps and checks what any such run must show (the ratio and the
clip act, lag-0 agreement, admission's waste, the console's length); 24 steps cannot hold a learning bar
(calibration/gspo-24.json: the 99% bounds of ten runs are at or below 0). The learning checks are `-m learning`:
100 steps held to calibrated bars, and 400 steps.

Both start from a warm start kept in the tree (tests/data/gspo-warmstart: the CPU demo's supervised warm start,
`run.seed=0`, exported on 2026-11-29; 1.7 MB), not from the one the demo run beside them makes. A warm start differs
from machine to machine (the same seed on another CPU rounds floats differently) and from seed to seed, and how much
100 GSPO steps gain depends on where they start: calibration/gspo-100-warmstart-seeds.json, warm starts of seeds 1-4,
gained greedy +0.122, +0.120, +0.059 and +0.005 (seeds 3 and 4 start at greedy 0.542 and 0.577). Bars calibrated
on one machine's warm start (calibration/gspo-100-behaviour-ratio.json) failed a CI run on another machine's (greedy
+0.053 from 0.565, 2026-11-28): the open finding of issue 59, explained by this. From one fixed warm start, the
spread left is the run's own (the samplers' timing), which the calibration measures.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.e2e.test_demo import MAX_WASTE, Run, trajectory, up
from tests.e2e.test_up import check_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WARMSTART = pathlib.Path(__file__).resolve().parents[1] / "data" / "gspo-warmstart"

# Bars: the one-sided 99% lower prediction bound for one new run, mean - t(0.99, n-1) * sd * sqrt(1 + 1/n), from n
# measured runs of the same setup (made with `python -m grpo_stream.bench.learning_spread gspo-100 --warmstart
# tests/data/gspo-warmstart`), rounded down: a healthy run whose gain is normal fails a bar with probability <= 1%
# (the expected false-failure rate of each check).
GSPO_CHECK_STEPS = 24  # the default lane's run (about 60 s of a worker)
GSPO_SHORT_STEPS = 100
# calibration/gspo-100-fixed-warmstart.json (2026-11-29: 10 runs, two at once as CI's two workers run them, on a
# loaded machine; mean staleness 1.45-1.58):
# - sampled pass@1 gain: +0.058 to +0.120, mean 0.079, sd 0.020, bound 0.0187, rounded down to 0.015. FFR <= 1%. A
#   run that does not learn (gain 0, evaluation noise sd 0.013) passes it with about 12%: the greedy bar is the one
#   that tells learning from none.
# - greedy accuracy gain: +0.059 to +0.134, mean 0.088, sd 0.026, bound 0.0125, rounded down to 0.01. FFR <= 1%.
#   Greedy decoding is deterministic: a model RL did not change gains exactly 0 and fails it.
GSPO_SHORT_MIN_SAMPLED_GAIN = 0.015
GSPO_SHORT_MIN_GREEDY_GAIN = 0.01
# 400 steps: bars of calibration/gspo-admission.json (another warm start, GSPO's objective before issue 44: sampled
# +0.039 to +0.142, bound 0.021; greedy +0.005 to +0.142, too spread for a learning bar, held to not falling by more
# than 0.04). Not recalibrated on this warm start; the 100-step check is the calibrated one.
GSPO_STEPS = 400
GSPO_MIN_SAMPLED_GAIN = 0.02
GSPO_MIN_GREEDY_GAIN = -0.04


def gspo_run(tmp_path: pathlib.Path, steps: int) -> Run:
    """GSPO from the kept warm start with two optimizer steps per batch, checked for what any length of such a run
    must show."""
    run = up(tmp_path / "run", "model.kind=hf", f"model.path={WARMSTART}", "warmstart.steps=0",
             "algo.loss_algo=gspo-token", "algo.minibatches=2", f"trainer.steps={steps}")
    check_run(run.summary, replicas=2, steps=steps)
    assert run.summary["algo"]["loss_algo"] == "gspo-token" and run.summary["algo"]["minibatches"] == 2
    # admission control (on by default): samplers generated (nearly) only what the trainer could use
    assert run.summary["generation_wasted_fraction"] <= MAX_WASTE, (run.summary["groups_generated"],
                                                                    run.summary["samplers"])
    rows = [r for r in run.metrics() if "train/ratio_max" in r]
    assert len(rows) == steps
    # the ratio left 1 and the clip acted: this run exercised what sets GSPO apart (the demo's ratio is exactly 1)
    assert sum(r["train/ratio_max"] > 1.0 + 1e-4 for r in rows) >= steps // 2, [r["train/ratio_max"] for r in rows]
    assert sum(r["train/clip_fraction"] > 0 for r in rows) >= steps // 2, [r["train/clip_fraction"] for r in rows]
    # groups made with exactly the trainer's weights (every group of step 1, at least) agree in float32
    agreement = run.summary["logprob_agreement_lag0"]
    assert agreement["tokens"] > 0 and agreement["mean_abs"] < 1e-5, agreement
    assert len(run.stdout.splitlines()) <= 400, f"{len(run.stdout.splitlines())} console lines"
    before, after = run.summary["eval_before"], run.summary["eval_after"]
    print(f"gspo ({steps} steps): sampled pass@1 {before['pass_at_k']['1']:.3f} -> {after['pass_at_k']['1']:.3f}, "
          f"greedy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, wall {run.summary['wall_seconds']}s")
    return run


@pytest.mark.learning  # 112 s of a worker: beside the GSPO learning checks (CI time; GSPO's loss is checked in the default lane)
def test_a_gspo_run_shows_its_ratio_and_clip_acting(tmp_path):
    """24 steps, gspo_run's checks (GSPO's objective itself: test_gspo_off_policy.py, test_loss.py); no learning
    bar: see the module's docstring."""
    run = gspo_run(tmp_path, GSPO_CHECK_STEPS)
    assert run.summary["eval_after"]["num_problems"] == run.summary["eval_before"]["num_problems"] > 0


@pytest.mark.learning
def test_gspo_learns_in_100_steps(tmp_path):
    """100 steps (~100 s of an idle worker, ~3 minutes in a lane of two workers), held to the calibrated bars
    above."""
    run = gspo_run(tmp_path, GSPO_SHORT_STEPS)
    before, after = run.summary["eval_before"], run.summary["eval_after"]
    assert after["pass_at_k"]["1"] - before["pass_at_k"]["1"] >= GSPO_SHORT_MIN_SAMPLED_GAIN, (
        before["pass_at_k"], after["pass_at_k"], trajectory(run))
    assert after["accuracy"] - before["accuracy"] >= GSPO_SHORT_MIN_GREEDY_GAIN, (
        before["accuracy"], after["accuracy"], trajectory(run))


@pytest.mark.learning
def test_gspo_learns_over_400_steps(tmp_path):
    """GSPO's learning over 400 steps (about 7 minutes on 2 cores)."""
    run = gspo_run(tmp_path, GSPO_STEPS)
    before, after = run.summary["eval_before"], run.summary["eval_after"]
    gain = after["pass_at_k"]["1"] - before["pass_at_k"]["1"]
    assert gain >= GSPO_MIN_SAMPLED_GAIN, (before["pass_at_k"], after["pass_at_k"], trajectory(run))
    assert after["accuracy"] - before["accuracy"] >= GSPO_MIN_GREEDY_GAIN, (before["accuracy"], after["accuracy"],
                                                                             trajectory(run))
