"""The CPU demo end to end: RL must clearly raise held-out accuracy (issue acceptance)."""

import json

import pytest

from tests.e2e.test_up import check_run, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_improves_heldout_accuracy(tmp_path):
    run_dir = tmp_path / "demo"
    proc = run_cli("up", "--config", "configs/tiny_arith.yaml", "--run-dir", str(run_dir), timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    check_run(summary, replicas=2, steps=summary["steps"])
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["num_problems"] >= 200 and after["num_problems"] == before["num_problems"]
    assert after["accuracy"] - before["accuracy"] >= 0.15, (before["accuracy"], after["accuracy"])
    for versions in summary["sampler_weight_versions"].values():
        assert len(versions) >= 3
    print(f"demo: accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}, wall {summary['wall_seconds']}s")
