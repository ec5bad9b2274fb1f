"""`up` keeps the run going by itself: kill -9 of a sampler, the trainer, the standalone ingest and the embedded
Redis, one after another during RL, and nobody restarts anything by hand. `up` restarts each (the trainer resumes
from its checkpoint, Redis from its AOF, the sampler from its data position), the run reaches its step count,
exits 0, counts the restarts in summary.json, and the audit finds nothing lost and nothing trained twice."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.support import stop_process
from tests.e2e.test_up import ROOT, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 24


def pid_of(*words: str) -> int | None:
    """The process whose command line holds every one of `words`."""
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(w in cmdline for w in words):
            return int(proc.name)
    return None


def test_up_restarts_what_dies_and_the_run_completes(tmp_path):
    run_dir, name = tmp_path / "run", f"sup-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_stream", "up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir",
         str(run_dir), f"run.name={name}", f"trainer.steps={STEPS}", "checkpoint.every=3", "ingest.standalone=true",
         "logging.step_every=1", "trainer.eval_after=false", "up.restart_backoff_s=0.5"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # (process to kill, how to find it, the trainer step after which to kill it)
    faults = [("sampler-0", (" sampler ", "--index 0", name), 3), ("trainer", (" trainer ", name), 7),
              ("redis-server", ("redis-server", "address unknown"), 11), ("ingest", (" ingest ", name), 15)]
    lines, done, deadline = [], [], time.monotonic() + 600
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[up] embedded Redis at redis://"):  # redis-server retitles itself 'HOST:PORT'
                address = line.split("redis://")[1].split("/")[0]
                faults[2] = ("redis-server", ("redis-server", address), faults[2][2])
            if "[trainer]" in line and "step " in line and faults:
                who, words, after = faults[0]
                step = next((int(w.split("/")[0]) for w in line.split() if "/" in w and w.split("/")[0].isdigit()),
                            None)
                if step is not None and step >= after:
                    pid = pid_of(*words)
                    assert pid is not None, f"no process for {who}: {words}"
                    os.kill(pid, signal.SIGKILL)
                    done.append(who)
                    faults.pop(0)
            assert time.monotonic() < deadline, "".join(lines[-60:])
        proc.wait(timeout=120)
    finally:
        stop_process(proc)
    text = "".join(lines)
    assert proc.returncode == 0, text[-6000:]
    assert done == ["sampler-0", "trainer", "redis-server", "ingest"], text[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["resumed_from"] is not None  # the restarted trainer resumed
    restarts = summary["restarts"]
    assert all(restarts[who] >= 1 for who in done), restarts
    assert restarts["sampler-1"] == 0, restarts
    for who in done:
        assert f"[up] {who} exited with code" in text and "restarting it in" in text
    audit = run_cli("audit", str(run_dir), timeout=120)
    assert audit.returncode == 0 and "0 lost; 0 trained twice" in audit.stdout, audit.stdout + audit.stderr
