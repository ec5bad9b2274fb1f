"""Issue 58: on the CPU, `grpo-stream plan`'s expected peak resident memory of each process against the peaks a real
run measures (`host_memory.peak_resident_bytes` in summary.json and sampler-<i>.json): SmolLM2-135M-Instruct in
float32, configs/smollm2_arith.yaml, shortened to 14 steps that keep what sets the peaks (the trainer's checkpoint at
step 12 while step 13 updates; the sampler's versions installed while it generates) and the end (the last
checkpoint, the held-out evaluation, the export). About 8 minutes on 2 cores; lane `realmodel`."""

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.realmodel, pytest.mark.e2e, pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = "configs/smollm2_arith.yaml"
TOLERANCE = 0.30  # the bar; the estimate leaves out what the C allocator keeps (docs/plan.md)


def cli(*args: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_stream.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_plan_states_each_process_peak_within_30_percent_of_a_run(tmp_path, smollm2_dir):
    overrides = [f"model.path={smollm2_dir}", "trainer.steps=14",
                 f"runtime.compilation_cache_dir={tmp_path / 'cache'}"]  # compiled afresh, as plan measures it
    planned = cli("plan", "--config", CONFIG, "--json", str(tmp_path / "plan.json"), *overrides, timeout=900)
    assert planned.returncode == 0, planned.stdout + planned.stderr
    doc = json.loads((tmp_path / "plan.json").read_text())
    run = tmp_path / "run"
    ran = cli("up", "--config", CONFIG, "--run-dir", str(run), *overrides, timeout=1800)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    measured = {"trainer": json.loads((run / "summary.json").read_text()),
                "sampler": json.loads((run / "sampler-0.json").read_text())}
    for role, report in measured.items():
        peak = report["host_memory"]["peak_resident_bytes"]
        expected = doc[role]["host_peak_bytes"]
        assert abs(expected - peak) <= TOLERANCE * peak, (role, expected / 2 ** 30, peak / 2 ** 30,
                                                          doc[role]["host_peak"]["parts"])
