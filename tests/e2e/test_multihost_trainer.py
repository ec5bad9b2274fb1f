"""A trainer of two JAX processes (issue 23): multi-controller JAX on CPU, 2 processes x 2 fake devices (fsdp=4),
started by `up` as a multi-host slice would run it, with two tensor-parallel samplers (tp=2) fetching every
version's slices from both trainer processes.

The first run is the smoke config end to end with its defaults (warm start, export, evaluation before and after),
every process seeing 4 devices (XLA_FLAGS, as a user sets it: each takes its share of the mesh): the samplers' final
parameters have the trainer's SHA-256, and the final parameters equal a one-process, four-device replay of the same
groups (the run records each step's batch; tests/e2e/multihost_reference.py replays them). In the second, trainer
process 1 raises mid-run (follower_fault/sitecustomize.py): it exits at once, `up` stops the job and starts both
processes again, they resume from the newest checkpoint, and the audit finds no group lost and none trained twice.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from tests.support import stop_process
from tests.e2e.test_up import ROOT, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CONFIG = "configs/tiny_arith_smoke.yaml"
TWO_HOSTS = ["trainer.processes=2", "trainer.mesh.fsdp=4", "sampler.mesh.tp=2", "weights.verify_prompts=8"]


def four_devices() -> str:
    """XLA_FLAGS for processes that each see 4 devices, keeping the compile flag tests/conftest.py gives the
    processes tests start (set once the tests are collected: read when a test starts, not at import)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()


def test_two_process_trainer_matches_one_process_and_every_sampler(tmp_path):
    run_dir = tmp_path / "run"
    # Adam's eps at 1e-5 (not 1e-8): the smoke run's first informative steps are Adam's first, where each element
    # moves by about +-lr whatever its gradient's size, so an element whose gradient is ~0 by cancellation flips
    # sign with the order of the float sums (two processes against one); one such flip in a small tensor is ~1e-4
    # of its norm (CI at 449224b: 9.8e-5, the losses equal to 8 digits; usually 4e-7). A larger eps makes the update
    # continuous at 0, so the comparison sees the arithmetic, not that discontinuity
    # the reward every group varies in (tests/e2e/vllm_rewards.py): every step moves the weights, whatever the smoke
    # model happens to sample (its arithmetic rewards are mostly all zero), so the replay compares real updates
    out = run_cli("up", "--config", CONFIG, "--run-dir", str(run_dir), *TWO_HOSTS, "trainer.record_batches=true",
                  "trainer.optimizer.eps=1e-5", "task.rewards={tests.e2e.vllm_rewards:longer_is_better: 1.0}",
                  env={"XLA_FLAGS": four_devices(),
                       "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_processes"] == 2 and summary["trainer_mesh"] == {"fsdp": 4, "tp": 1}
    assert summary["steps"] == 8 and summary["groups_trained"] == 32
    final = summary["final_weights"]
    assert final["version"] == 8 and any(final["greedy"])
    for name, doc in summary["samplers"].items():
        assert doc["final_weights"]["sha256"] == final["sha256"], f"{name}: parameters differ from the trainer's"
        assert doc["final_weights"]["greedy"] == final["greedy"], f"{name}: greedy outputs differ"
    for i in range(2):  # each sampler took its slices from both trainer processes
        assert "weights from 2 trainer processes" in (run_dir / "logs" / f"sampler-{i}.log").read_text()
    follower = (run_dir / "logs" / "trainer-1.log").read_text()
    assert "trainer process 1 of 2" in follower and "trainer process 1 done at step 8" in follower
    assert summary["eval_before"] is not None and summary["eval_after"] is not None
    assert (run_dir / "model" / "config.json").is_file()  # the export, gathered from both processes
    reference = subprocess.run([sys.executable, "-m", "tests.e2e.multihost_reference", str(run_dir)], cwd=ROOT,
                               capture_output=True, text=True, timeout=300,
                               env={**os.environ, "XLA_FLAGS": four_devices()})
    assert reference.returncode == 0, reference.stdout[-2000:] + reference.stderr[-3000:]
    result = json.loads(reference.stdout.strip().splitlines()[-1])
    assert result["steps_replayed"] == 8 and result["checkpoint_step"] == 8
    assert result["rl_moved_rel"] > 1e-3, result  # RL changed the parameters: the comparison means something
    assert result["max_rel_diff"] <= 1e-5, result


def check_restarted_job(run_dir: pathlib.Path, steps: int, resumed: tuple[int, ...]) -> None:
    """A job restarted once finished every step from one of the checkpoint steps `resumed`, both processes logged
    across the restart, every sampler ended with the trainer's parameters, and the audit finds nothing lost or
    trained twice."""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps and summary["restarts"]["trainer"] == 1
    assert summary["resumed_from"] is not None and summary["resumed_from"]["step"] in resumed, summary["resumed_from"]
    final = summary["final_weights"]
    for name, doc in summary["samplers"].items():
        assert doc["final_weights"]["sha256"] == final["sha256"], f"{name}: parameters differ from the trainer's"
    follower = (run_dir / "logs" / "trainer-1.log").read_text()
    assert follower.count("trainer process 1 of 2") == 2  # its log goes on across the restart
    audit = run_cli("audit", str(run_dir), timeout=120)
    assert audit.returncode == 0 and "0 lost; 0 trained twice" in audit.stdout, audit.stdout + audit.stderr


@pytest.mark.chaos  # ~3 minutes of a worker in CI (2026-11-28): beside its SIGKILL variant, out of the default lane
def test_a_follower_that_raises_mid_run_restarts_the_job_from_its_checkpoint(tmp_path):
    run_dir, name, steps = tmp_path / "run", f"mh-{uuid.uuid4().hex[:8]}", 12
    marker = tmp_path / "fault-injected"
    hooks = str(pathlib.Path(__file__).with_name("follower_fault"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_stream", "up", "--config", CONFIG, "--run-dir", str(run_dir), *TWO_HOSTS,
         f"run.name={name}", f"trainer.steps={steps}", "checkpoint.every=2", "logging.step_every=1",
         "logging.verbose=true", "trainer.eval_after=false", "up.restart_backoff_s=0.5"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "FOLLOWER_FAULT_STEP": "6", "FOLLOWER_FAULT_MARKER": str(marker),
             "PYTHONPATH": os.pathsep.join(filter(None, [hooks, os.environ.get("PYTHONPATH")]))})
    lines, hung = [], threading.Event()
    watchdog = threading.Timer(600, lambda: (hung.set(), proc.kill()))  # a job that hangs fails the test
    watchdog.start()
    try:
        for line in proc.stdout:  # up ends the job itself: no process is left waiting for the failed one
            lines.append(line)
        proc.wait(timeout=120)
    finally:
        watchdog.cancel()
        stop_process(proc)
    assert not hung.is_set(), "".join(lines[-60:])
    text = "".join(lines)
    assert marker.exists() and proc.returncode == 0, text[-6000:]
    assert "injected fault: trainer process 1 fails at step 6" in text, text[-6000:]
    assert "[up] trainer exited with code" in text and "restarting it in" in text, text[-6000:]
    # from a checkpoint: step 4's, or step 2's when step 4's asynchronous save had not committed on both processes
    check_restarted_job(run_dir, steps, resumed=(2, 4))


def process_with_env(marker: str, variable: str) -> int | None:
    """The trainer process whose command line holds `marker` and whose environment holds `variable`."""
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if " trainer " in cmdline and marker in cmdline and variable.encode() in env:
            return int(proc.name)
    return None


@pytest.mark.chaos
def test_killing_trainer_process_1_restarts_the_job_from_its_checkpoint(tmp_path):
    """SIGKILL (a preempted host) instead of an exception: the same restart from the newest checkpoint. In the chaos
    lane: the raising follower above covers the default lane's restart."""
    run_dir, name, steps = tmp_path / "run", f"mh-{uuid.uuid4().hex[:8]}", 12
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_stream", "up", "--config", CONFIG, "--run-dir", str(run_dir), *TWO_HOSTS,
         f"run.name={name}", f"trainer.steps={steps}", "checkpoint.every=2", "logging.step_every=1",
         "logging.verbose=true",
         "trainer.eval_after=false", "up.restart_backoff_s=0.5"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, killed, saved, deadline = [], None, False, time.monotonic() + 600
    try:
        for line in proc.stdout:
            lines.append(line)
            # kill it mid-run once the checkpoint of step 4 is on disk (saves are asynchronous), after step 5
            saved = saved or (line.startswith("[trainer] ") and "checkpoint of step 4 saved" in line)
            if killed is None and saved and line.startswith("[trainer] ") and " step " in line and any(
                    f" step {k}/" in line for k in range(5, steps)):
                killed = process_with_env(name, "JAX_PROCESS_ID=1")
                assert killed is not None, "no trainer process 1"
                os.kill(killed, signal.SIGKILL)
            assert time.monotonic() < deadline, "".join(lines[-60:])
        proc.wait(timeout=120)
    finally:
        stop_process(proc)
    text = "".join(lines)
    assert killed is not None and proc.returncode == 0, text[-6000:]
    assert "[up] trainer exited with code" in text and "restarting it in" in text, text[-6000:]
    check_restarted_job(run_dir, steps, resumed=(4, 6, 8, 10))  # it was killed once step 4's save was on disk
