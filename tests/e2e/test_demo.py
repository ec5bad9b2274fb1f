"""The CPU demo end to end as a user runs it (the README's first command), in the `learning` lane (`-m learning`;
about 5-10 minutes of a worker: its 600-step warm start, 400 RL steps and five evaluations), run once (a module
fixture) and checked for everything it must show: RL clearly raises held-out accuracy, every ingested group is
accounted for, weights reach both samplers, the samplers' logprobs agree with the trainer's at lag 0, and the closing
line and report show the figures. The default lane's learning check is GSPO's 100 steps from the demo's warm start
kept in the tree (tests/e2e/test_gspo_learning.py): a third of the time, and the same bars on every machine.

Learning thresholds are checks on one run, set from measured runs (bench/learning_spread.py; the runs are in
tests/e2e/calibration/) and from runs seen inside CI's suite: see the constants below.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from tests.e2e.test_up import check_run, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.learning]

# The demo's bars are set against a run that does not learn (below), not from a prediction bound (the GSPO checks'
# way: tests/e2e/test_gspo_learning.py). The demo as shipped (admission control on, continuous engine; calibration/demo-admission.json, 2026-11-25: 12 runs,
# three idle, eight two at once as CI's two workers run them, one beside GSPO runs): sampled pass@1 gain +0.143 to
# +0.200 (mean 0.175, sd 0.016), greedy gain +0.132 to +0.220 (mean 0.168, sd 0.024).
# Those runs (one machine, mostly idle) did not show the spread of CI's suite, where the demo shares two cores with
# every other test: inside it one run gained +0.090 sampled (8c84c3f) and one +0.123 sampled, +0.0885 greedy (32f9be9,
# failing the earlier greedy bar of 0.09, the calibration's 99% bound). An idle run on a slower AMD machine (2026-11-26,
# other float rounding: its warm start scores 0.430 sampled, not 0.465) gained +0.176 sampled, +0.198 greedy.
# So the bars are set against a run that does not learn, with room below every healthy run seen:
# - sampled pass@1: a run whose policy did not move scores the same up to evaluation noise (sd 0.013 over 3072
#   completions), so 0.06 is 4.6 of that sd above no change, and 2/3 of the lowest healthy gain seen (0.090).
DEMO_MIN_SAMPLED_GAIN = 0.06
# - greedy accuracy: deterministic (a model RL did not change scores exactly +0), and it moves in jumps on a
#   0.4M-parameter model (one carry habit flips many problems at once): 0.04 is below every healthy run (lowest 0.0885).
DEMO_MIN_GREEDY_GAIN = 0.04
# In a same-session idle A/B (two runs each, alternating) the demo without admission gained more (sampled +0.175,
# +0.189 against +0.158, +0.143; greedy +0.165, +0.182 against +0.146, +0.132) in the same wall time (252, 253 s
# against 255, 260 s) while wasting 13.5% of its generation (admission: 0.4%, 0.25%).
# Earlier setups (calibration/demo.json: static engine, no admission, mean sampled gain 0.158;
# demo-continuous-engine.json: no admission, 0.171).
# - generation_wasted_fraction (groups generated for training but never trained), with admission control on: the
#   acceptance bound of issue 21, not a fitted bar.
MAX_WASTE = 0.03


@dataclasses.dataclass
class Run:
    dir: pathlib.Path
    stdout: str
    summary: dict

    def metrics(self) -> list[dict]:
        return [json.loads(line) for line in (self.dir / "metrics-trainer.jsonl").read_text().splitlines()]


def trajectory(run: Run, every: int = 50) -> str:
    """What a failed learning check prints: per `every` steps the mean training accuracy, staleness, entropy,
    gradient norm, clip fraction and off-policy health (per-group ESS of the importance weights, mismatch KL), so
    a run that fell apart shows when and how."""
    rows = [r for r in run.metrics() if "train/accuracy" in r]
    parts = []
    for i in range(0, len(rows), every):
        chunk = rows[i:i + every]
        mean = lambda key: sum(r.get(key, float("nan")) for r in chunk) / len(chunk)  # noqa: E731
        parts.append(f"steps {chunk[0]['step']}-{chunk[-1]['step']}: acc {mean('train/accuracy'):.3f} staleness "
                     f"{mean('train/staleness_mean'):.2f} entropy {mean('train/entropy'):.4f} grad_norm "
                     f"{mean('train/grad_norm'):.3f} clip {mean('train/clip_fraction'):.3f} ess "
                     f"{mean('train/is_ess_group_mean'):.3f} mismatch_kl {mean('train/mismatch_kl_k3'):.4f}")
    return "\n".join(parts)


def up(run_dir: pathlib.Path, *overrides: str) -> Run:
    proc = run_cli("up", "--config", "configs/tiny_arith.yaml", "--run-dir", str(run_dir), *overrides, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Run(run_dir, proc.stdout, json.loads((run_dir / "summary.json").read_text()))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Run:
    """The shipped demo as a user runs it (one optimizer step per batch, grpo, admission control on)."""
    return up(tmp_path_factory.mktemp("demo") / "run")


def test_demo_raises_heldout_accuracy(demo):
    before, after = demo.summary["eval_before"], demo.summary["eval_after"]
    assert before["num_problems"] >= 700 and after["num_problems"] == before["num_problems"]
    # Judged on sampled pass@1 (4 completions for each of 768 held-out problems) and on greedy accuracy, which moves
    # in jumps on a 0.4M-parameter model (one carry habit flips many problems at once).
    sampled_gain = after["pass_at_k"]["1"] - before["pass_at_k"]["1"]
    greedy_gain = after["accuracy"] - before["accuracy"]
    print(f"demo: greedy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, sampled pass@1 "
          f"{before['pass_at_k']['1']:.3f} -> {after['pass_at_k']['1']:.3f}, wall {demo.summary['wall_seconds']}s")
    assert sampled_gain >= DEMO_MIN_SAMPLED_GAIN, (before["pass_at_k"], after["pass_at_k"], trajectory(demo))
    assert greedy_gain >= DEMO_MIN_GREEDY_GAIN, (before["accuracy"], after["accuracy"], trajectory(demo))
    # admission control: the samplers generated (nearly) only what the trainer could use (issue 21's bound)
    assert demo.summary["generation_wasted_fraction"] <= MAX_WASTE, (demo.summary["groups_generated"],
                                                                     demo.summary["samplers"])


def test_demo_accounts_for_every_group_and_both_samplers_follow_the_weights(demo):
    summary = demo.summary
    check_run(summary, replicas=2, steps=summary["steps"])
    assert summary["algo"]["loss_algo"] == "grpo" and summary["steps"] == 400
    # one optimizer step per batch: the trainer's importance ratio is exactly 1 (test_gspo_learning.py: where not)
    rows = [r for r in demo.metrics() if "train/ratio_max" in r]
    assert len(rows) == 400 and all(r["train/ratio_max"] == r["train/ratio_min"] == 1.0 for r in rows)
    # versions reached the samplers all along the run, not only at its ends
    for versions in summary["sampler_weight_versions"].values():
        assert len(versions) >= 3


def test_demo_lag0_logprobs_agree(demo):
    # groups generated with exactly the trainer's weights (every group of step 1, at least) agree in float32
    agreement = demo.summary["logprob_agreement_lag0"]
    assert agreement["tokens"] > 0 and agreement["mean_abs"] < 1e-5, agreement


def test_demo_closing_line_and_report_show_both_measures(demo):
    before, after = demo.summary["eval_before"], demo.summary["eval_after"]
    assert (f"greedy accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, sampled pass@1 "
            f"{before['pass_at_k']['1']:.3f} -> {after['pass_at_k']['1']:.3f}") in demo.stdout, demo.stdout[-500:]
    rep = run_cli("report", str(demo.dir), timeout=300)
    assert rep.returncode == 0, rep.stderr[-3000:]
    report = (demo.dir / "report" / "report.md").read_text()
    assert (f"| held-out sampled pass@1 before → after | {before['pass_at_k']['1']:.3f} → "
            f"{after['pass_at_k']['1']:.3f} |") in report, report
    # every plot shows series that move over the demo; what stays constant is listed with its reason, and only
    # what is constant by construction in the default config (one optimizer step per batch) may be, or by design:
    # with admission control a whole run may drop no group as stale (seen in CI at 32a869c), and may keep every
    # group under trainer.max_staleness (4), so no token is trained at lag 4; the demo's samplers take each version
    # in flight (sampler.weight_updates' default), so groups mix versions and their plot ("mixed_versions") is drawn
    index = json.loads((demo.dir / "report" / "plots.json").read_text())
    # the held-out curve (eval.every_steps: 100 in the demo): before RL, every 100 steps while it runs, and after
    assert index["plots"].pop("heldout") == {"steps": [0, 100, 200, 300, 400]}, index["plots"].get("heldout")
    assert [row["step"] for row in demo.summary["eval_curve"]] == [0, 100, 200, 300, 400], demo.summary["eval_curve"]
    assert set(index["plots"]) == {"reward_accuracy", "off_policy", "staleness", "update", "lengths", "throughput",
                                   "buffer", "off_policy_health", "staleness_by_version", "mixed_versions"}, index
    for plot, series in index["plots"].items():
        for key, spread in series.items():
            assert spread["max"] > spread["min"] and spread["points"] == demo.summary["steps"], (plot, key, spread)
    assert set(index["constant"]) <= {"train/ratio_max", "train/ratio_min", "train/clip_fraction", "train/ppo_kl",
                                      "train/clip_fraction_low", "train/clip_fraction_high",
                                      "train/staleness_max", "train/truncated_fraction", "train/is_weight_min",
                                      "train/groups_dropped_stale", "train/staleness_tokens_lag4",
                                      "train/mixed_version_groups",
                                      *(f"train/mixed_version_tokens_lag{s}" for s in range(5))}, index
    assert all(c["why"] for c in index["constant"].values()), index["constant"]
    assert len(demo.stdout.splitlines()) <= 400, f"{len(demo.stdout.splitlines())} console lines"
