"""scripts/gpu-check.sh against the device tool's limits: its one call of at most 600 s, killed at the limit, on a
machine lent for 15 minutes of device time in all. The deadline counts the wheels' install, the check's processes die
with it, a phase in progress shows in the JSON, an optional phase is not started without time for its figures and is
excused (not failed) when the deadline cuts it short, and a JAX that fell back to the CPU says why."""

import json
import os
import pathlib
import subprocess
import sys
import time

import psutil

from grpo_stream.bench.async_vs_sync import mode_overrides
from grpo_stream.gpu_check import env
from grpo_stream.gpu_check.figures import missing_figures
from grpo_stream.gpu_check.modes import GPU, setup_seconds
from grpo_stream.gpu_check.run import BIG_CONFIG, Runner, main

ROOT = pathlib.Path(__file__).resolve().parents[2]

# a check's process whose one run writes its pid and sleeps: the test kills the check as the device tool does
CHECK = r"""
import pathlib, sys, time
from grpo_stream.gpu_check.modes import DRY
from grpo_stream.gpu_check.run import Runner
tmp = pathlib.Path(sys.argv[1])
runner = Runner(DRY, tmp, tmp / "work", 300.0, dry_run=True)
child = f"import os, time; open({str(tmp / 'run.pid')!r}, 'w').write(str(os.getpid())); time.sleep(600)"
runner.run([sys.executable, "-c", child], tmp / "run.log", time.monotonic() + 600)
"""


def _gone(proc: psutil.Process, within_s: float) -> bool:
    """Whether `proc` ended (a zombie nobody reaped counts) within `within_s` seconds."""
    for _ in range(int(within_s * 10)):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_the_checks_processes_die_with_it(tmp_path):
    """A call killed at the device tool's limit kills the check's process; its runs (in sessions of their own, as
    Ctrl-C must reach `up` alone) ran on, holding the GPU's memory into the next call."""
    check = subprocess.Popen([sys.executable, "-c", CHECK, str(tmp_path)], cwd=ROOT)
    pid_file, run = tmp_path / "run.pid", None
    try:
        for _ in range(1200):  # the check's imports, then its run's start: seconds, more on a loaded machine
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.1)
        run = psutil.Process(int(pid_file.read_text()))
        check.kill()
        check.wait()
        assert _gone(run, within_s=30), "the check's run outlived it"
    finally:
        check.kill()
        if run is not None and not _gone(run, 0):
            run.kill()


def test_the_deadline_counts_from_the_scripts_start(tmp_path, monkeypatch):
    """The wheels' install and the import check run before the check's process, inside the same 600 s call: a
    deadline counted from the process's start ran the call past the device tool's limit when they were slow."""
    assert setup_seconds("1000", now=1030.5) == 30.5
    assert setup_seconds(None) == setup_seconds("soon") == setup_seconds("1000", now=1000 + 7200) == 0.0
    seen = {}
    monkeypatch.setattr(Runner, "main", lambda self, realmodel=False: seen.update(left=self.left(), doc=self.doc) or 0)
    monkeypatch.setenv("GPU_CHECK_STARTED", str(time.time() - 100))
    assert main(["--dry-run", "--deadline-s", "300", "--out", str(tmp_path / "out"), "--work",
                 str(tmp_path / "work")]) == 0
    assert 190 < seen["left"] <= 200 and seen["doc"]["setup_s"] >= 100 and seen["doc"]["deadline_s"] == 300
    assert "GPU_CHECK_STARTED" not in os.environ  # the runs it starts do not inherit it


def test_gpu_check_sh_starts_the_clock_before_the_install(tmp_path):
    fake = tmp_path / "python"  # imports whatever it is asked to; as the check, prints the clock it was given
    fake.write_text('#!/bin/bash\n[ "$1" = "-m" ] && echo "started=$GPU_CHECK_STARTED"\nexit 0\n')
    fake.chmod(0o755)
    before = int(time.time())
    proc = subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "GPU_CHECK_PYTHON": str(fake)})
    assert proc.returncode == 0, proc.stderr
    assert before <= float(proc.stdout.split("started=")[1]) <= time.time()


def _gpu_runner(tmp_path, left_s: float) -> Runner:
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "work").mkdir(exist_ok=True)
    runner = Runner(GPU, tmp_path / "out", tmp_path / "work", 570.0, dry_run=False)
    runner.end = time.monotonic() + left_s
    return runner


def _phases(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "gpu-check.json").read_text())["phases"]


def test_a_phase_in_progress_is_in_the_json(tmp_path):
    """The JSON was written when a phase ended: a call killed mid-phase came back without a word of it."""
    runner, seen = _gpu_runner(tmp_path, 500), []
    runner.phase("async", lambda: seen.append(_phases(tmp_path)["async"]["status"]) or {"status": "ok"})
    assert seen == ["running"] and _phases(tmp_path)["async"] == {"status": "ok"}


def test_an_optional_phase_without_time_for_its_figures_is_not_started(tmp_path):
    """The one-process run started 40 s before its stop compiles and is stopped before a figure (2026-11-28: one step
    in 38 s), spending a minute of the lent GPU's time on nothing and failing the check."""
    runner, started = _gpu_runner(tmp_path, GPU.stop_grace_s + 40), []
    runner.phase("colocated", lambda: started.append("colocated") or {"status": "ok"})
    runner.phase("engine", lambda: started.append("engine") or {"status": "ok"})  # its first load fits
    assert started == ["engine"] and _phases(tmp_path)["colocated"] == {"status": "skipped", "reason": "deadline"}


ENGINE_ARGS = ["--config", BIG_CONFIG, "trainer.groups_per_step=8", "buffer.max_groups=16"]


def _engine_phase(tmp_path, left_s: float) -> dict:
    """The engine phase, `left_s` before the deadline, whose `bench gpu engine` timed the admitted rows' load and
    skipped the full one for its deadline."""
    runner = _gpu_runner(tmp_path, left_s)

    def fake_run(cmd, log_path, stop_at, env=None):
        pathlib.Path(cmd[cmd.index("--out") + 1]).write_text(json.dumps({
            "rows": 256, "tokens_per_second": 400.0,
            "loads": {"32": {"tokens_per_second": 400.0}, "256": {"skipped": "deadline"}}}))
        return {"exit_code": 0, "stopped": False, "seconds": 50.0}

    runner.run = fake_run
    runner.phase("engine", lambda: runner.engine_alone(ENGINE_ARGS, mode_overrides("sync", 8, 1)))
    return _phases(tmp_path)["engine"]


def test_an_optional_phase_the_deadline_cut_short_is_excused(tmp_path):
    """On a GPU the engine alone and the one-process run come if time remains: the engine's full load skipped, or
    the one-process run stopped, because the check's deadline came are what a skip for it is. They failed the
    check (`passed` false on every run whose later phases met the deadline, as designed)."""
    engine = _engine_phase(tmp_path, 100)  # its stop: the deadline (55 s away), before its cap (90 s)
    assert engine["status"] == "ok" and engine["loads_untimed"] == ["256"] and engine["reason"] == "deadline"
    compared = {"sampler_over_engine_sync_same_rows": 0.9}  # the full load's figures are not there
    optional = ("engine", "colocated", "plan")
    assert not [m for m in missing_figures({"engine": engine, "comparison": compared}, True, optional)
                if "engine" in m]
    runner = _gpu_runner(tmp_path, 130)  # its stop: the deadline (85 s away), before its 120 s cap
    runner.run = lambda cmd, log_path, stop_at, env=None: {"exit_code": 0, "stopped": True, "seconds": 85.0}
    runner.phase("colocated", lambda: runner.up("colocated", [], 16, colocated=True))
    colocated = _phases(tmp_path)["colocated"]
    assert colocated["status"] == "stopped" and colocated["reason"] == "deadline"
    runner.doc["missing_figures"] = []
    runner.doc["phases"].update({p: {"status": "ok"} for p in ("environment", "demo", "async", "sync", "engine")},
                                plan={})
    runner.doc["phases"]["environment"]["backend"] = "gpu"
    assert runner.verdict() == 0


def test_a_shortfall_the_deadline_did_not_cause_still_fails(tmp_path):
    engine = _engine_phase(tmp_path, 500)  # its stop: its own cap
    assert engine["loads_untimed"] == ["256"] and "reason" not in engine
    compared = {"sampler_over_engine_sync_same_rows": 0.9}
    assert "comparison.engine_tokens_per_second" in missing_figures({"engine": engine, "comparison": compared}, True,
                                                                    ("engine", "colocated", "plan"))
    runner = _gpu_runner(tmp_path, 130)  # a crash is a crash, whatever would have stopped it
    runner.run = lambda cmd, log_path, stop_at, env=None: {"exit_code": 1, "stopped": False, "seconds": 5.0}
    runner.phase("colocated", lambda: runner.up("colocated", [], 16, colocated=True))
    assert _phases(tmp_path)["colocated"]["status"] == "failed" and "reason" not in _phases(tmp_path)["colocated"]


def test_a_jax_on_the_cpu_keeps_what_its_probe_printed(tmp_path, monkeypatch):
    """A CUDA plugin that does not match jax leaves JAX on the CPU with a warning on stderr, and the check ends after
    this phase; the warning was dropped, so the next call would have had to ask again."""
    warning = "CUDA backend failed to initialize: jax-cuda13-plugin 0.11.1 does not match jaxlib 0.11.2"
    facts = {"python": "3.12.3", "backend": "cpu", "devices": [{"id": 0, "kind": "cpu", "platform": "cpu"}]}

    def fake_run(cmd, **kwargs):
        if "--format=csv,noheader" in cmd:  # a real H200's answer
            return subprocess.CompletedProcess(cmd, 0, "NVIDIA H200, 580.159.04, 143771 MiB\n", "")
        return subprocess.CompletedProcess(cmd, 0, json.dumps(facts) + "\n", f"WARNING: {warning}\n")

    monkeypatch.setattr(env.shutil, "which", lambda _name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(env.subprocess, "run", fake_run)
    found = env.environment(tmp_path, 3000)
    assert found["status"] == "ok" and warning in found["probe_stderr"]
    assert found["nvidia_smi"] == ["NVIDIA H200, 580.159.04, 143771 MiB"]
    runner = _gpu_runner(tmp_path, 500)
    runner.record("environment", found)
    assert "probe_stderr" in runner.no_gpu()
    facts.update(backend="gpu", devices=[{"id": 0, "kind": "NVIDIA H200", "platform": "gpu"}])
    assert "probe_stderr" not in env.environment(tmp_path, 3000)  # on the GPU its warnings are noise
