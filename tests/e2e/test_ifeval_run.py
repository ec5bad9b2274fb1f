"""The whole loop on IFEval prompts (configs/tiny_ifeval.yaml: tests/data/ifeval in google/IFEval's format, the
tiny model, lm-eval's checks as rewards): the trainer takes its steps on groups scored by ifeval_strict and
ifeval_loose, each reported in the metrics; `eval` on the exported model prints lm-eval's four IFEval figures and
agrees with the trainer's held-out evaluation."""

import json

import pytest

from tests.e2e.test_up import check_run, run_cli

# -m heavy: a minute of a worker; the default lane holds IFEval's rewards against lm-eval's own scoring
# (tests/unit/common/tasks/test_ifeval.py) and the loop under `up` on other tasks
pytestmark = [pytest.mark.e2e, pytest.mark.heavy]
FIGURES = ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc")


def test_up_on_ifeval_trains_and_eval_prints_the_four_figures(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("up", "--config", "configs/tiny_ifeval.yaml", "--run-dir", str(run_dir), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    check_run(summary, replicas=2, steps=4)
    rows = [json.loads(line) for line in (run_dir / "metrics-trainer.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # both rewards computed and reported; strict (weight 1) is the reward, loose never below it
        strict, loose = r["train/reward/ifeval_strict"], r["train/reward/ifeval_loose"]
        assert 0.0 <= strict <= loose <= 1.0 and r["train/reward_mean"] == pytest.approx(strict, abs=1e-6)
    after = summary["eval_after"]
    assert after["num_problems"] == 12 and list(after["task_metrics"]) == list(FIGURES)
    assert all(0.0 <= v <= 1.0 for v in after["task_metrics"].values())

    out = tmp_path / "eval.json"
    ev = run_cli("eval", "--config", "configs/tiny_ifeval.yaml", "--json", str(out), "model.kind=hf",
                 f"model.path={run_dir / 'model'}", timeout=300)
    assert ev.returncode == 0, ev.stderr[-3000:]
    line = ev.stdout.strip().splitlines()[-1]
    assert line.startswith("test: 12 problems, prompt_level_strict_acc "), line
    assert all(f"{name} {after['task_metrics'][name]:.4f}" in line for name in FIGURES), line
    result = json.loads(out.read_text())  # the same greedy completions as the trainer's evaluation, so the same
    assert result["task_metrics"] == after["task_metrics"] and result["examples"] == after["examples"]
