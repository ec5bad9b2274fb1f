"""One `up` per run directory, and nothing left behind (issue 41, finding 5), against real `up` runs.

The faults: a kill -9 (or a SIGHUP) of `up` left its children running in their own sessions; `up` again on the
same directory then started a second Redis on the same append-only file and a second trainer on the same
checkpoints. And a stop while Redis is down waited for Redis: the trainer retried it until `up` killed it 120 s
later (finding 10)."""

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

from grpo_stream.up.run_lock import RunDirBusy, RunLock
from tests.e2e.test_up import ROOT, run_cli
from tests.support import stop_process, wait_for

pytestmark = pytest.mark.e2e
QUICK = ["trainer.eval_before=false", "trainer.eval_after=false", "warmstart.steps=0", "logging.step_every=1"]


class UpRun:
    """`grpo-stream up` on the tiny config as a real process, its output collected line by line."""

    def __init__(self, run_dir: pathlib.Path, *overrides: str):
        self.name = f"guard-{uuid.uuid4().hex[:8]}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "grpo_stream", "up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir",
             str(run_dir), f"run.name={self.name}", "ingest.standalone=true", *QUICK, *overrides],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for_line(self, needle: str, timeout_s: float = 120) -> None:
        def seen():
            assert self.proc.poll() is None or needle in self.text, self.text[-3000:]
            return needle in self.text
        wait_for(seen, timeout_s, f"{needle!r} in up's output")

    def children(self) -> dict[int, str]:
        """pid -> command line of every process `up` started that still runs."""
        out = {}
        for proc in pathlib.Path("/proc").iterdir():
            if proc.name.isdigit() and alive(int(proc.name)):
                try:
                    if int((proc / "stat").read_text().rpartition(")")[2].split()[1]) == self.proc.pid:
                        out[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                except (OSError, ValueError, IndexError):
                    continue
        return out

    def stop(self) -> None:
        stop_process(self.proc, grace_s=60)
        self._reader.join(timeout=10)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def of_run(name: str) -> list[int]:
    """Processes whose command line names run `name` (every child of `up` but Redis)."""
    out = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and name in (proc / "cmdline").read_bytes().decode(errors="replace") \
                    and alive(int(proc.name)):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


def lock_free(run_dir: pathlib.Path) -> bool:
    try:
        RunLock.acquire(run_dir, "test").release()
        return True
    except RunDirBusy:
        return False


def every_role(children: dict[int, str]) -> bool:
    """Redis, the trainer, the ingest and both samplers are running."""
    cmds = list(children.values())
    return (any("redis-server" in c for c in cmds) and sum(" sampler " in c for c in cmds) == 2
            and any(" trainer " in c for c in cmds) and any(" ingest " in c for c in cmds))


def test_a_second_up_is_refused_and_kill_9_of_up_leaves_nothing_running(tmp_path):
    run_dir = tmp_path / "run"
    first = UpRun(run_dir)
    try:
        children = wait_for(lambda: (lambda c: c if every_role(c) else None)(first.children()), 60,
                            "every process of the run")
        second = run_cli("up", "--config", "configs/tiny_arith_smoke.yaml", "--run-dir", str(run_dir), *QUICK,
                         timeout=60)
        assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
        assert f"run directory {run_dir.resolve()} is in use by grpo-stream up (pid {first.proc.pid}" \
            in second.stderr, second.stderr
        assert "embedded Redis" not in second.stdout  # refused before it started anything
        assert all(alive(pid) for pid in children)  # and it disturbed nothing of the first run

        first.proc.kill()  # kill -9 of `up`: its processes die with it
        first.proc.wait()
        wait_for(lambda: not any(alive(pid) for pid in children) and not of_run(first.name), 10,
                 "no process of the killed run left (also none `up` restarted meanwhile)")
        wait_for(lambda: lock_free(run_dir), 5, "the directory's lock to be free again")
    finally:
        first.stop()
        for pid in first.children():
            os.kill(pid, signal.SIGKILL)


def test_sighup_stops_the_run_cleanly_like_ctrl_c(tmp_path):
    run = UpRun(tmp_path / "run", "trainer.steps=100000", "checkpoint.every=2")
    try:
        run.wait_for_line("step 2/")
        children = run.children()
        run.proc.send_signal(signal.SIGHUP)  # a closed terminal or ssh session
        assert run.proc.wait(timeout=90) == 130, run.text[-4000:]
    finally:
        run.stop()
    assert not any(alive(pid) for pid in children), run.children()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_early"] and summary["checkpoints_saved"][-1] == summary["steps"] >= 2
    assert all(code == 0 for code in summary["sampler_exit_codes"].values()), summary["sampler_exit_codes"]
    assert "did not stop within" not in run.text and "ingest stopped" in run.text


@pytest.mark.chaos  # 24 s: a fault run, beside the others
def test_a_stop_while_redis_is_down_ends_every_process_promptly(tmp_path):
    """Redis killed mid-run and not restarted yet (a long restart back-off), then SIGTERM: every process exits
    within seconds, none killed by `up` after its grace, and the checkpoint is kept for the resume."""
    run = UpRun(tmp_path / "run", "trainer.steps=100000", "checkpoint.every=2", "up.restart_backoff_s=600",
                "up.restart_backoff_max_s=600")
    try:
        run.wait_for_line("step 2/")
        children = run.children()
        redis = next(pid for pid, cmd in children.items() if "redis-server" in cmd)
        os.kill(redis, signal.SIGKILL)
        run.wait_for_line("[up] redis-server exited with code -9; restarting it in")
        run.wait_for_line("Redis unavailable")  # the trainer is in a retry loop
        started = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        run.proc.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        run.stop()
    assert not any(alive(pid) for pid in children), run.children()
    assert took < 30, (took, run.text[-4000:])
    assert "did not stop within" not in run.text, run.text[-4000:]
    assert run.proc.returncode == 130, run.text[-4000:]
    assert "while stopping; not retried" in run.text or "stopped while waiting for Redis" in run.text, run.text[-4000:]
