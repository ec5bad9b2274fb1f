"""scripts/gpu-check.sh runs once on a lent GPU: what must not end it early or lose figures already measured (a torn
metrics line, a phase that raises, a probe that hangs, a GGUF part gone between calls, an engine phase stopped after
its first load, an engine whose slots are not whole groups, a wheel download that got nothing)."""

import json
import os
import pathlib
import subprocess

import pytest

from grpo_stream.bench.async_vs_sync import mode_overrides
from grpo_stream.gpu_check import env, realmodel
from grpo_stream.gpu_check.engine import engine_command
from grpo_stream.gpu_check.figures import comparison, missing_figures, run_figures, sampler_figures
from grpo_stream.gpu_check.modes import DRY, GPU
from grpo_stream.gpu_check.run import Runner

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROW = {"train/staleness_mean": 0.0, "train/staleness_max": 0, "train/compute_seconds": 1.0, "train/wait_seconds": 0.5,
       "train/step_seconds": 2.0}


def test_a_torn_last_metrics_line_keeps_the_runs_figures(tmp_path):
    lines = [json.dumps({"step": k, "time": 100.0 + 2 * k, **ROW}) for k in range(1, 7)]
    torn = lines[-1][: lines[-1].index("train/staleness_mean") + 30]  # a kill mid-write, past the key it filters on
    (tmp_path / "metrics-trainer.jsonl").write_text("\n".join(lines) + "\n" + torn)
    run = run_figures(tmp_path, 7)
    assert run["steps"] == 6 and run["steady_seconds_per_step"] == 2.0


def _runner(tmp_path) -> Runner:
    (tmp_path / "out").mkdir()
    return Runner(DRY, tmp_path / "out", tmp_path / "work", 300.0, dry_run=True)


def test_a_phase_that_raises_is_recorded_and_the_next_one_runs(tmp_path):
    runner = _runner(tmp_path)

    def broken():
        raise KeyError("train/compute_seconds")

    runner.phase("async", broken)
    runner.phase("sync", lambda: {"status": "ok"})
    phases = json.loads((tmp_path / "out" / "gpu-check.json").read_text())["phases"]
    assert phases["async"]["status"] == "failed" and "KeyError" in phases["async"]["error"]
    assert "train/compute_seconds" in phases["async"]["log_tail"] and phases["sync"]["status"] == "ok"


@pytest.mark.parametrize("stdout", ["timeout", "not json\n", ""])
def test_a_probe_that_hangs_or_prints_no_json_is_a_failed_phase(tmp_path, monkeypatch, stdout):
    def fake_run(cmd, **kwargs):
        if stdout == "timeout":
            raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])
        return subprocess.CompletedProcess(cmd, 0, stdout, "a warning")

    monkeypatch.setattr(env.shutil, "which", lambda _name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(env.subprocess, "run", fake_run)
    result = env.environment(tmp_path, 3000)
    assert result["status"] == "failed" and result["log_tail"]


def test_a_missing_part_is_named_not_joined(tmp_path, monkeypatch):
    parts = tmp_path / ".realmodel"
    parts.mkdir()
    (parts / "smollm2.gguf.part-1").write_bytes(b"tail")  # part-0 went with a machine given back
    with pytest.raises(ValueError, match="part-0 is not there"):
        realmodel.join(parts, tmp_path / "joined.gguf")
    monkeypatch.setattr(realmodel, "PARTS", parts)

    class Bare:
        work = tmp_path

    result = realmodel.realmodel_phase(Bare(), tmp_path)
    assert result["status"] == "failed" and "part-0" in result["reason"]


def test_an_engine_phase_stopped_after_the_admitted_rows_keeps_issue_55s_figure():
    engine = {"rows": 256, "tokens_per_second": 400.0, "sync_admitted_rows": 32,
              "loads": {"32": {"tokens_per_second": 400.0}, "256": {"skipped": "deadline"}}}
    sync = {"samplers": {"sampler-0": sampler_figures({"tokens_generated": 1200, "generate_seconds": 4.0})}}
    compared = comparison({}, sync, None, engine)
    assert compared["sampler_over_engine_sync_same_rows"] == 0.75  # 300 tokens/s over 400
    assert compared["engine_tokens_per_second"] is None and "sampler_over_engine_sync" not in compared
    # the full load's figures are missing, not present as None
    missing = missing_figures({"comparison": compared, "engine": {"status": "ok"}}, device_memory=False,
                              optional=("colocated", "plan"))
    assert "comparison.engine_tokens_per_second" in missing
    assert "comparison.sampler_over_engine_sync_same_rows" not in missing


def test_slots_that_are_not_whole_groups_are_timed_at_the_rows_the_sampler_holds(tmp_path):
    """256 slots and groups of 6: the sampler starts whole groups, so it holds 42 of them (252 rows). The engine phase
    asked `bench gpu engine` for a load of 256, which it refuses (a load is whole groups): the phase failed before it
    timed even the synchronous run's admitted rows, issue 55's figure."""
    args = ["--config", "configs/qwen2.5_1.5b_gsm8k_gpu.yaml", "trainer.groups_per_step=8", "buffer.max_groups=16",
            "generation.num_generations=6"]
    cmd, held = engine_command(args, mode_overrides("sync", 8, 1), tmp_path / "cache", tmp_path / "engine.json", 60)
    assert held == 48 and [cmd[i + 1] for i, a in enumerate(cmd) if a == "--rows"] == ["48", "252"]


def test_gpu_wheels_says_how_many_wheels_it_got_when_pip_gets_none(tmp_path):
    """A pip that fetches nothing (no network, a version gone): the script counted the wheels with `ls`, whose failure
    under pipefail ended it silently before the line naming the shortfall."""
    proc = subprocess.run(["bash", "scripts/gpu-wheels.sh", str(tmp_path / "whl")], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHON": "false"})
    assert proc.returncode == 1 and "gpu-wheels: got 0 wheels of 17" in proc.stderr


@pytest.mark.parametrize("found", [{"status": "ok", "backend": "cpu", "devices": [{"kind": "cpu"}]},
                                   {"status": "failed", "log_tail": "ImportError: jax_cuda13_plugin"}])
def test_a_gpu_run_whose_jax_sees_no_gpu_ends_after_the_environment(tmp_path, found):
    """A CUDA plugin that fails to load leaves JAX on the CPU: the check went on to run the demo and the ~1B runs
    there, spending the lent GPU's whole call to measure nothing. It ends at once, saying why."""
    (tmp_path / "out").mkdir()
    runner = Runner(GPU, tmp_path / "out", tmp_path / "work", 540.0, dry_run=False)
    started = []
    runner.environment = lambda: found
    runner.up = lambda phase, *args, **kwargs: started.append(phase) or {"status": "failed", "figures": None}
    runner.background = lambda name, *args, **kwargs: started.append(name) or {"status": "failed", "exit_code": 1}
    assert runner.main() == 1 and started == []
    doc = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert doc["problems"][0].startswith("no GPU: the environment phase found JAX's backend")
    assert all(doc["phases"][p]["reason"] == doc["problems"][0] for p in ("demo", "async", "sync", "engine"))


def test_a_realmodel_run_whose_jax_sees_no_gpu_skips_its_phase(tmp_path):
    (tmp_path / "out").mkdir()
    runner = Runner(GPU, tmp_path / "out", tmp_path / "work", 540.0, dry_run=False)
    runner.environment = lambda: {"status": "ok", "backend": "cpu", "devices": []}
    runner.up = lambda *args, **kwargs: pytest.fail("the real-model run started without a GPU")
    assert runner.main(realmodel=True) == 1
    phase = json.loads((tmp_path / "out" / "gpu-check.json").read_text())["phases"]["realmodel"]
    assert phase["status"] == "skipped" and phase["reason"].startswith("no GPU")
