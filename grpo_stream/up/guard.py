"""What keeps one `up` the only owner of its run directory and its processes (issue 41, finding 5).

- The run directory's lock (grpo_stream/up/run_lock.py): `up` takes it before it starts anything and hands its
  descriptor to the trainer and the embedded Redis, so the directory stays locked while any of them lives; a
  second `up` there is refused with the holder's pid.
- Children that die with `up` (grpo_stream/up/parent_death.py): PR_SET_PDEATHSIG in every child, and Python
  children also watch their parent pid, so a kill -9 of `up` leaves nothing running that would write the run.
- SIGHUP (a closed terminal or ssh session) stops the run like SIGTERM and Ctrl-C: the trainer checkpoints.
"""

from __future__ import annotations

import errno
import pathlib
import signal
import sys

from grpo_stream.up.parent_death import child_env, die_with_parent
from grpo_stream.up.relay import say_now
from grpo_stream.up.run_lock import LOCK_FD_ENV, RunDirBusy, RunLock

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def lock_run_dir(run_dir: pathlib.Path) -> RunLock | None:
    """The run directory's lock for this `up`; None, after printing why (the directory, its holder's pid), when
    another run holds it."""
    try:
        return RunLock.acquire(run_dir, "grpo-stream up", wait_s=2.0)
    except RunDirBusy as exc:
        message = str(exc)
    except OSError as exc:
        message = run_dir_error(run_dir, exc)
    say_now(f"grpo-stream up: error: {message}", sys.stderr)
    return None


def run_dir_error(run_dir: pathlib.Path, exc: OSError) -> str:
    """Why `up` could not prepare its run in `run_dir`, naming the directory (a write's "No space left on device"
    names no file) and, for a disk that is full or a directory it may not write, the fix."""
    where = f" ({exc.filename})" if exc.filename else ""
    fix = ("; free space there, make it writable for this user, or choose another --run-dir"
           if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM) else "")
    return f"cannot prepare the run in {run_dir}: {exc.strerror or exc}{where}{fix}"


def child_popen(env: dict[str, str]) -> dict:
    """Popen keyword arguments of a Python child: its environment (with this process's pid, which it watches), death
    with this process, and the run directory's lock when `env` names it (the trainer's)."""
    return {"env": child_env(env), "preexec_fn": die_with_parent(),
            "pass_fds": (int(env[LOCK_FD_ENV]),) if LOCK_FD_ENV in env else ()}


def redis_popen(lock: RunLock) -> dict:
    """Popen keyword arguments of the embedded redis-server: it dies with this process and holds the run's lock.

    It runs in a process group of its own: a terminal's Ctrl-C (or `timeout`, or a service manager's SIGTERM to the
    group) reaches every process of the foreground group at once, and a Redis stopped with the others leaves the
    trainer no buffer to acknowledge its last step in (it retried its lease until `up`'s grace ran out). `up` stops
    Redis itself, last, once the trainer and samplers have ended."""
    return {"preexec_fn": die_with_parent(), "pass_fds": (lock.fd,), "process_group": 0}
