"""The calibration tool's arithmetic: the one-sided 99% prediction bound a learning check's bar comes from, and the
distillation figures against the kept teacher (steps to reach its accuracy, the final gap, the KL ratio's upper
bound)."""

import pytest

from grpo_stream.bench.learning_spread import (DISTILL_DEFAULTS, figures, lower_bound, spread, steps_to_reach, t99,
                                               teacher_accuracy)


def test_the_bound_is_the_t_prediction_bound_and_never_above_the_lowest_run():
    values = [0.10, 0.12, 0.14, 0.11, 0.13, 0.12, 0.10, 0.15, 0.11, 0.12]
    b = lower_bound(values)
    assert b["n"] == 10 and b["mean"] == pytest.approx(0.12, abs=1e-4)
    assert b["bound_99"] == pytest.approx(0.12 - 2.821 * b["sd"] * (1.1 ** 0.5), abs=2e-4)
    assert lower_bound([0.5, 0.5])["bound_99"] == 0.5  # no spread: the lowest run
    with pytest.raises(ValueError, match="--runs"):
        lower_bound([0.1])


# Student's t 99% quantiles (scipy.stats.t.ppf(0.99, df), written out: scipy is no dependency of grpo-stream)
EXACT_T99 = {20: 2.527977, 24: 2.492159, 29: 2.462021, 49: 2.404892, 99: 2.364606, 999: 2.330086}


@pytest.mark.parametrize("df", sorted(EXACT_T99))
def test_the_t_quantile_past_the_table_is_the_exact_one(df):
    """Past 20 runs the quantile is computed, not looked up: a low one (the old 2.33 + 2.33 / (4 df) gave 2.359 for
    21 runs, not 2.528) would set a bar a healthy run misses more often than the 1% the bound promises."""
    assert t99(df) == pytest.approx(EXACT_T99[df], abs=1e-5)


def test_a_21_run_bound_uses_the_21_run_quantile():
    values = [0.1 + 0.01 * i for i in range(20)]
    values.append(sum(values) / 20)
    b = lower_bound(values)
    assert b["bound_99"] == pytest.approx(b["mean"] - EXACT_T99[20] * b["sd"] * (1 + 1 / 21) ** 0.5, abs=2e-4)


def test_steps_to_reach_is_the_first_evaluated_step_at_the_target():
    curve = {"0": 0.50, "25": 0.62, "50": 0.58, "75": 0.70, "100": 0.69}
    assert steps_to_reach(curve, 0.60) == 25 and steps_to_reach(curve, 0.70) == 75
    assert steps_to_reach(curve, 0.71) is None


def run(after: float, kl_ratio: float) -> dict:
    summary = {"eval_before": {"accuracy": 0.5}, "eval_after": {"accuracy": after}, "wall_seconds": 100.0,
               "eval_curve": [{"step": 0, "accuracy": 0.5}, {"step": 100, "accuracy": after}]}
    return {**figures(summary), "distill_kl_ratio": kl_ratio}


def test_distillation_figures_are_against_the_kept_teachers_accuracy():
    teacher = teacher_accuracy(DISTILL_DEFAULTS["teacher"])
    assert 0.5 < teacher < 1.0
    runs = [run(teacher - 0.02, 0.2), run(teacher - 0.04, 0.3), run(teacher + 0.01, 0.1)]
    assert "sampled_pass1_gain" not in runs[0]  # evaluated greedy only (eval.samples=0)
    out = spread(runs, "distill")
    assert out["teacher_accuracy"] == teacher
    assert out["gap_to_teacher"]["mean"] == pytest.approx(-0.0167, abs=1e-4)
    assert out["gap_to_teacher"]["bound_99"] <= -0.04
    assert out["steps_to_teacher_within_0.0"] == [None, None, 100]
    assert out["steps_to_teacher_within_0.02"] == [100, None, 100]
    kl = out["distill_kl_ratio"]
    assert kl["max"] == 0.3 and kl["bound_99_upper"] >= 0.3 and kl["mean"] == pytest.approx(0.2)


def test_a_run_scored_by_its_own_rewards_is_measured_by_them():
    """A run whose task.rewards is not answer_correct (the SmolLM2 demo's last_number) learns by its reward: its
    held-out reward gain is a figure of its own, bounded like the others, beside the answer_correct accuracy."""
    def scored(before: float, after: float) -> dict:
        return figures({"eval_before": {"accuracy": 0.0, "reward": before},
                        "eval_after": {"accuracy": 0.0, "reward": after}, "wall_seconds": 300.0})
    runs = [scored(0.148, 0.148 + gain) for gain in (0.23, 0.18, 0.27)]
    assert runs[0]["greedy_gain"] == 0.0 and runs[0]["reward_gain"] == pytest.approx(0.23)
    out = spread(runs, "smollm2")
    assert out["reward_gain"]["min"] == pytest.approx(0.18) and out["reward_gain"]["bound_99"] <= 0.18


# a calibration of `demo` (run_once stubbed) whose rewrite of --out fails part way: EFBIG under RLIMIT_FSIZE, as
# ENOSPC on a full disk; in a child process, so the limit touches nothing of the test run's own files
_FAILED_REWRITE = """
import json, pathlib, resource, signal, sys
from grpo_stream.bench import learning_spread
out = pathlib.Path(sys.argv[1])
learning_spread.run_once = lambda *a, **k: {"greedy_gain": 0.2, "wall_seconds": 1.0, "note": "x" * 4096}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (out.stat().st_size + 1000, resource.RLIM_INFINITY))
try:
    learning_spread.main(["demo", "--runs", "1", "--out", str(out)])
except OSError as exc:
    print("write failed:", exc.errno)
"""


def test_a_failed_rewrite_of_the_calibration_file_keeps_its_earlier_runs(tmp_path):
    """The file is rewritten after every run and holds every earlier one (hours of runs): a rewrite in place that
    fails part way (a full disk, a kill) left a truncated, unreadable file and lost them all."""
    import errno
    import json
    import pathlib
    import subprocess
    import sys

    out = tmp_path / "demo.json"
    earlier = {"setup": "demo", "runs": [{"greedy_gain": 0.1 + k / 100, "wall_seconds": 1.0} for k in range(10)]}
    out.write_text(json.dumps(earlier, indent=2) + "\n")
    root = pathlib.Path(__file__).resolve().parents[3]
    proc = subprocess.run([sys.executable, "-c", _FAILED_REWRITE, str(out)], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert f"write failed: {errno.EFBIG}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(out.read_text()) == earlier
    assert [p.name for p in tmp_path.iterdir()] == ["demo.json"]  # the temporary file removed
