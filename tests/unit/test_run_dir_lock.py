"""The run directory's lock and children that die with their parent, with real OS processes (issue 41, finding 5):
the lock outlives the process that took it while a child holds its descriptor, a refusal names the processes to
stop, and a child whose parent is gone stops even where PR_SET_PDEATHSIG is missing."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from grpo_stream.up.parent_death import PARENT_PID_ENV
from grpo_stream.up.run_lock import RunDirBusy, RunLock
from tests.support import wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]

# takes the lock, hands its descriptor to a child that sleeps (as `up` hands it to the trainer and Redis), exits
TAKER = textwrap.dedent("""
    import subprocess, sys
    from grpo_stream.up.run_lock import RunLock
    lock = RunLock.acquire(sys.argv[1], "grpo-stream up")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lock.fd,),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
""")


def test_the_lock_outlives_its_taker_while_a_child_holds_it_and_the_refusal_names_that_child(tmp_path):
    taker = subprocess.run([sys.executable, "-c", TAKER, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, check=True)
    holder = int(taker.stdout.split()[0])
    try:
        with pytest.raises(RunDirBusy) as refused:
            RunLock.acquire(tmp_path, "grpo-stream up")
        message = str(refused.value)
        assert f"run directory {tmp_path.resolve()} was locked by grpo-stream up (pid " in message
        assert "which has exited, but its processes still hold it" in message and f"{holder} (" in message
    finally:
        os.kill(holder, 9)  # (not this process's child: its parent exited, so it is reaped elsewhere)
    wait_for(lambda: _free(tmp_path), 10, "the lock to be free once its last holder died")


def _free(run_dir) -> bool:
    try:
        RunLock.acquire(run_dir, "test").release()
        return True
    except RunDirBusy:
        return False


def test_a_live_taker_is_named_with_its_pid(tmp_path):
    lock = RunLock.acquire(tmp_path, "grpo-stream up")
    try:
        with pytest.raises(RunDirBusy, match=rf"is in use by grpo-stream up \(pid {os.getpid()}, started .*kill -TERM "
                                             rf"{os.getpid()}.*another --run-dir"):
            RunLock.acquire(tmp_path, "grpo-stream up")
    finally:
        lock.release()
    RunLock.acquire(tmp_path, "grpo-stream up").release()


# the child: watches its parent, without PR_SET_PDEATHSIG (as where the kernel lacks it)
WATCHER = textwrap.dedent("""
    import os, time
    from grpo_stream.up import parent_death
    parent_death.set_parent_death_signal = lambda sig=None: False
    parent_death.watch_parent(every_s=0.1, on_gone=lambda pid: (print("parent", pid, "gone", flush=True), os._exit(7)))
    print("watching", flush=True)
    time.sleep(60)
""")
# the parent: starts the watcher (both write to the file argv[1]), waits until it watches, prints its pid and exits
ORPHANING_PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    out, code = sys.argv[1], sys.argv[2]
    with open(out, "a") as sink:
        child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "%s": str(os.getpid())},
                                 stdout=sink)
    deadline = time.monotonic() + 30
    while "watching" not in open(out).read() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(child.pid)
""" % PARENT_PID_ENV)


def test_a_child_notices_its_parent_is_gone_without_the_kernels_signal(tmp_path):
    out = tmp_path / "out"
    parent = subprocess.run([sys.executable, "-c", ORPHANING_PARENT, str(out), WATCHER], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=True)
    child = int(parent.stdout.split()[0])
    try:
        wait_for(lambda: "gone" in out.read_text(), 20, "the orphan to notice its parent is gone")
    finally:
        try:
            os.kill(child, 9)
        except ProcessLookupError:
            pass
    assert out.read_text().startswith("watching")


def test_a_run_directory_on_a_full_disk_is_refused_naming_it_and_the_fix(tmp_path, monkeypatch, capsys):
    """A full disk surfaced as a bare `[Errno 28] No space left on device` (a write's error names no file), with
    the lock's descriptor left open."""
    from grpo_stream.up import run_lock
    from grpo_stream.up.guard import lock_run_dir

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(run_lock.os, "pwrite", full)
    assert lock_run_dir(tmp_path) is None
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert err.startswith(f"grpo-stream up: error: cannot prepare the run in {tmp_path}: No space left on device "
                          f"({tmp_path.resolve() / 'run.lock'}); free space there")
    assert _free(tmp_path)  # not left locked by the failed attempt


def test_a_run_directory_up_cannot_write_stops_up_before_it_starts_anything(tmp_path, monkeypatch, capsys):
    """Past the lock (devices.json, the logs, Redis's password file, the tokens, config.yaml): a traceback ending
    in a bare errno, or in the middle of starting Redis."""
    from grpo_stream.common.config.loading import load_config
    from grpo_stream.up import run

    def unwritable(cfg, run_dir):
        raise OSError(errno.EROFS, "Read-only file system", str(run_dir / "devices.json"))
    monkeypatch.setattr(run, "device_plan", unwritable)
    assert run.run_up(None, [], load_config(None, []), tmp_path) == 1
    assert capsys.readouterr().err == (
        f"grpo-stream up: error: cannot prepare the run in {tmp_path}: Read-only file system "
        f"({tmp_path / 'devices.json'}); free space there, make it writable for this user, or choose another "
        "--run-dir\n")
    assert _free(tmp_path)


def test_a_symlink_planted_at_the_lock_path_is_refused_and_its_target_left_untouched(tmp_path):
    """run.lock opened without O_NOFOLLOW: a link another user planted there made `up` create or truncate (and
    write its pid record into) whatever file the link named."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.lock").symlink_to(victim)
    with pytest.raises(OSError) as refused:
        RunLock.acquire(run_dir, "grpo-stream up")
    assert refused.value.errno == errno.ELOOP and refused.value.filename == str(run_dir / "run.lock")
    assert "symbolic link" in str(refused.value) and "remove it" in str(refused.value)
    assert victim.read_text() == "precious"
    (run_dir / "run.lock").unlink()
    RunLock.acquire(run_dir, "grpo-stream up").release()  # once removed, the directory locks as before
