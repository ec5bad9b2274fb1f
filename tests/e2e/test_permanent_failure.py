"""A failure no restart can fix stops the run instead of looping: a sampler started with another model's settings
(here sampler-0 gets model.tiny.hidden_dim=128 where the trainer has 64, via other_model/sitecustomize.py) exits
with code 3 within 60 s of its start, naming both shapes, and `up` stops the run saying which process failed and
why, without restarting it."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import time

import pytest

from tests.e2e.test_up import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HOOKS = str(pathlib.Path(__file__).with_name("other_model"))


def log_seconds(line: str) -> float:
    """Seconds since midnight of a log line's HH:MM:SS stamp."""
    h, m, s = map(int, re.search(r"\b(\d\d):(\d\d):(\d\d)\b", line).groups())
    return datetime.timedelta(hours=h, minutes=m, seconds=s).total_seconds()


def test_a_sampler_of_another_model_stops_the_run_naming_both_shapes(tmp_path):
    run_dir = tmp_path / "run"
    out = run_cli("up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir), "warmstart.steps=0",
                  "trainer.eval_before=false", "trainer.eval_after=false", timeout=400,
                  env={"OTHER_MODEL_OVERRIDE": "model.tiny.hidden_dim=128",
                       "PYTHONPATH": os.pathsep.join(filter(None, [HOOKS, os.environ.get("PYTHONPATH")]))})
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-5000:]
    assert "[up] sampler-0 failed permanently (exit code 3), so it is not restarted" in text, text[-5000:]
    assert "restarting it in" not in text  # nothing was restarted into the same wall
    shapes = re.search(r"is \((\d+), (\d+)\) there and \((\d+), (\d+)\) here", text)
    assert shapes and {shapes.group(1), shapes.group(2)} != {shapes.group(3), shapes.group(4)}, text[-5000:]
    assert "64" in shapes.groups() and "128" in shapes.groups()
    record = json.loads((run_dir / "failures" / "sampler-0.json").read_text())
    assert record["process"] == "sampler-0" and "there and" in record["message"]
    log = (run_dir / "logs" / "sampler-0.log").read_text().splitlines()
    stamped = [line for line in log if re.search(r"\b\d\d:\d\d:\d\d\b", line)]
    failed_at = time.localtime(record["time"])  # written as the sampler exits
    failed = failed_at.tm_hour * 3600 + failed_at.tm_min * 60 + failed_at.tm_sec
    assert 0 <= failed - log_seconds(stamped[0]) < 60, (stamped[0], record)
