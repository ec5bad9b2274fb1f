"""On-policy distillation end to end, as a user runs it: `grpo-stream up` of the smoke demo with distill.teacher set
to a stronger teacher's Hugging Face directory (tests/e2e/distill_teacher.py: larger, of the same tokenizer), the
student trained by the teacher alone (distill.reward_weight 0): the step reports carry the KL to the teacher, its
quantiles and the teacher's log-prob. That distillation learns (the KL falls, the student nears the teacher's
accuracy) is checked on the demo's model with bars from ten runs: test_distill_learning.py (`-m learning`)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from tests.e2e.distill_teacher import make_teacher
from tests.e2e.test_up import check_run, run_cli

# -m heavy (about 45 s of a worker): the default lane holds the distillation objective (test_distill.py) and its
# plan (test_plan_teacher.py); -m learning runs distillation under `up` and checks that it learns
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.heavy]
STEPS = 24
KEYS = ("train/distill_kl", "train/distill_kl_p50", "train/distill_kl_p90", "train/distill_kl_p99",
        "train/distill_teacher_logprob")


@dataclasses.dataclass
class DistillRun:
    dir: pathlib.Path
    teacher: pathlib.Path
    rows: list[dict]


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory) -> DistillRun:
    tmp_path = tmp_path_factory.mktemp("distill")
    teacher = make_teacher(tmp_path / "teacher")
    run_dir = tmp_path / "run"
    proc = run_cli("up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir),
                   f"distill.teacher={teacher}", f"trainer.steps={STEPS}", "trainer.learning_rate=0.003",
                   "warmstart.steps=10", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics-trainer.jsonl").read_text().splitlines()]
    return DistillRun(run_dir, teacher, [r for r in rows if "train/distill_kl" in r])


def test_a_distillation_run_reports_its_kl_to_the_teacher(distill_run):
    run_dir, rows = distill_run.dir, distill_run.rows
    summary = json.loads((run_dir / "summary.json").read_text())
    check_run(summary, replicas=2, steps=STEPS)
    assert summary["distill"]["teacher"] == str(distill_run.teacher) and summary["distill"]["reward_weight"] == 0.0
    assert len(rows) == STEPS, len(rows)
    for r in rows:
        assert all(key in r for key in KEYS), sorted(r)
        assert r["train/distill_kl_p50"] <= r["train/distill_kl_p90"] <= r["train/distill_kl_p99"]
        assert r["train/distill_teacher_logprob"] < 0
    report = run_cli("report", str(run_dir), timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    plots = json.loads((run_dir / "report" / "plots.json").read_text())["plots"]
    assert "train/distill_kl" in plots["distillation"], plots.get("distillation")
