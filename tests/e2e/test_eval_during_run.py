"""Evaluation during the run (eval.every_steps, issue 59) under `grpo-stream up`: the smoke demo evaluates every 2
steps on the trainer's background thread; metrics-trainer.jsonl, TensorBoard, W&B (offline), summary.json and
`grpo-stream report` hold the held-out curve at the expected steps and versions."""

import json

import pytest

from tests.e2e.test_up import run_cli, tensorboard_tags
from tests.e2e.wandb_checks import WANDB_OFFLINE, offline_runs, read_run, wandb_env

pytestmark = pytest.mark.e2e
DUE = {2, 4, 6}  # every 2 of 8 steps; step 8's weights are eval_after's


def test_smoke_demo_reports_held_out_accuracy_every_two_steps(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir),
                   "eval.every_steps=2", "eval.samples=2", "eval.ks=[1,2]", *WANDB_OFFLINE, env=wandb_env(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["eval_errors"] == 0
    curve = summary["eval_curve"]
    during = [r["step"] for r in curve if r["when"] == "during"]
    # slower than training, a due version that waited is replaced by the next (counted); the newest due one and the
    # ends are always there
    assert set(during) | set(summary["eval_skipped"]) == DUE and not set(during) & set(summary["eval_skipped"])
    assert during == sorted(during) and 6 in during
    assert [r["step"] for r in curve] == [0, *during, 8] and [r["when"] for r in (curve[0], curve[-1])] == [
        "before", "after"]
    assert all(r["version"] == r["step"] and r["num_problems"] == 32 and set(r["pass_at_k"]) == {"1", "2"}
               and set(r["maj_at_k"]) == {"1", "2"} for r in curve)
    assert curve[-1]["accuracy"] == summary["eval_after"]["accuracy"]
    assert set(during) <= set(summary["weight_versions"])  # published versions only
    rows = [json.loads(line) for line in (run_dir / "metrics-trainer.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, *during, 8]
    assert all(r["eval/version"] == r["step"] and {"eval/pass_at_1", "eval/pass_at_2", "eval/maj_at_2", "eval/reward",
                                                   "eval/reward/answer_correct"} <= set(r) for r in evals)
    assert [r["eval/accuracy"] for r in evals] == pytest.approx([r["accuracy"] for r in curve])
    tags = tensorboard_tags(run_dir / "tb" / "trainer")
    assert {tags.get(t) for t in ("eval/accuracy", "eval/pass_at_1", "eval/maj_at_2", "eval/version")} == {"scalar"}
    (directory,) = offline_runs(run_dir)
    wandb_run = read_run(directory)
    logged = {r["eval/step"]: r["eval/accuracy"] for r in wandb_run.history if "eval/accuracy" in r}
    assert logged == pytest.approx({r["step"]: r["eval/accuracy"] for r in evals})
    rep = run_cli("report", str(run_dir), timeout=120)
    assert rep.returncode == 0, rep.stderr
    report = (run_dir / "report" / "report.md").read_text()
    assert "Held-out evaluation" in report and "| step (version) | greedy accuracy | maj@1 | maj@2 | pass@1 |" in report
    table = [line for line in report.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(line.split("|")[1]) for line in table] == [0, *during, 8]
    assert json.loads((run_dir / "report" / "plots.json").read_text())["plots"]["heldout"]["steps"] == [0, *during, 8]
    assert (run_dir / "report" / "heldout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
