"""The CPU demo end to end: RL must clearly raise held-out accuracy, with GRPO and with GSPO."""

import json

import pytest

from tests.e2e.test_up import check_run, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


# The shipped demo takes one optimizer step per batch: the ratio is then exactly 1 and GSPO's gradient
# equals GRPO's up to rounding (README, "The objective"); GSPO's sequence-level ratio and clip are
# covered by the hand-computed and Tunix parity tests.
@pytest.mark.parametrize("loss_algo", ["grpo", "gspo-token"])
def test_demo_improves_heldout_accuracy(tmp_path, loss_algo):
    run_dir = tmp_path / "demo"
    proc = run_cli("up", "--config", "configs/tiny_arith.yaml", "--run-dir", str(run_dir),
                   f"algo.loss_algo={loss_algo}", timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    check_run(summary, replicas=2, steps=summary["steps"])
    assert summary["algo"]["loss_algo"] == loss_algo
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["num_problems"] >= 700 and after["num_problems"] == before["num_problems"]
    # Learning is judged on sampled pass@1 (4 completions for each of 768 held-out problems). Greedy accuracy of a
    # 0.4M-parameter model moves in jumps, as one carry habit flips many problems at once: it gained +0.06 to +0.27
    # over the measured runs, sampled pass@1 +0.19 to +0.21 over three (README, "The CPU demo"). The samplers'
    # timing changes the data from run to run. Greedy accuracy must still clearly rise.
    sampled_gain = after["pass_at_k"]["1"] - before["pass_at_k"]["1"]
    greedy_gain = after["accuracy"] - before["accuracy"]
    assert sampled_gain >= 0.10, (before["pass_at_k"], after["pass_at_k"])
    assert greedy_gain >= 0.04, (before["accuracy"], after["accuracy"])
    # the closing line and the report show both measures
    assert (f"greedy accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, sampled pass@1 "
            f"{before['pass_at_k']['1']:.3f} -> {after['pass_at_k']['1']:.3f}") in proc.stdout, proc.stdout[-500:]
    rep = run_cli("report", str(run_dir), timeout=300)
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert (f"| held-out sampled pass@1 before → after | {before['pass_at_k']['1']} → {after['pass_at_k']['1']} |"
            in (run_dir / "report" / "report.md").read_text())
    for versions in summary["sampler_weight_versions"].values():
        assert len(versions) >= 3
    # groups generated with exactly the trainer's weights (every group of step 1, at least) agree in float32
    agreement = summary["logprob_agreement_lag0"]
    assert agreement["tokens"] > 0 and agreement["mean_abs"] < 1e-5, agreement
    print(f"demo {loss_algo}: greedy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, sampled pass@1 "
          f"{before['pass_at_k']['1']:.3f} -> {after['pass_at_k']['1']:.3f}, "
          f"wall {summary['wall_seconds']}s, lag-0 logprob diff {agreement}")
