"""What keeps one `up` the only owner of its run directory and its processes (issue 41, finding 5).

- The run directory's lock (grpo_stream/up/run_lock.py): `up` takes it before it starts anything and hands its
  descriptor to the trainer and the embedded Redis, so the directory stays locked while any of them lives; a
  second `up` there is refused with the holder's pid.
- Children that die with `up` (grpo_stream/up/parent_death.py): PR_SET_PDEATHSIG in every child, and Python
  children also watch their parent pid, so a kill -9 of `up` leaves nothing running that would write the run.
- SIGHUP (a closed terminal or ssh session) stops the run like SIGTERM and Ctrl-C: the trainer checkpoints. A second
  stop signal kills every process at once (`StopSignals`).
"""

from __future__ import annotations

import errno
import pathlib
import signal
import sys
from typing import Callable

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


class StartupSignals:
    """SIGTERM and SIGHUP before the processes start (the Redis waited for, the run prepared) stop `up` as Ctrl-C
    does, a KeyboardInterrupt: exit 130 saying so, the embedded Redis stopped. They killed it at once, silently,
    with 143 or 129 (systemd's and Kubernetes' stop is a SIGTERM). A SIGHUP ignored (nohup) stays ignored."""

    def __enter__(self) -> "StartupSignals":
        self.previous = {s: signal.signal(s, self._interrupt) for s in STOP_SIGNALS if s != signal.SIGINT
                         and not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)}
        return self

    @staticmethod
    def _interrupt(signum, _frame) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


class StopSignals:
    """Ctrl-C, SIGTERM and SIGHUP while the processes run: each is asked to stop (SIGTERM), and the watch ends. A
    second one kills them all at once (SIGKILL to their groups: each resumes from a kill -9): it only re-sent SIGTERM,
    and `up` waited out up.stop_grace_s for a trainer still checkpointing and STOP_S for each group of the others."""

    def __init__(self, children: list, say: Callable[[str], None]):
        """`children`: units with terminate() and kill_now() (grpo_stream/up/run.py); `say`: where its lines go."""
        self.children, self.say, self.interrupted, self.killing, self._unsaid = children, say, False, False, []
        # a SIGHUP ignored by who started `up` (nohup) stays ignored: logging out must not stop the run
        self.previous = {s: signal.signal(s, self._interrupt) for s in STOP_SIGNALS
                         if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)}

    def _interrupt(self, signum, _frame) -> None:
        # a handler runs on the main thread between two of its bytecodes, maybe inside CONSOLE.write with the
        # console's lock held: it takes no lock (a line written from here deadlocked `up` for good); the main
        # thread says the line (`say_received`). terminate() takes none (Popen.poll only tries its lock), nor
        # kill_now() (it reaps nothing)
        self.killing, self.interrupted = self.interrupted, True
        self._unsaid.append((signum, self.killing))
        for child in self.children:
            if self.killing:
                child.kill_now()
            else:
                child.terminate()

    def say_received(self) -> None:
        """Say, from the main thread, which stop signals came since the last call. Once killing, kill again what
        started meanwhile (a restart the watch made while the signal came)."""
        while self._unsaid:
            signum, killing = self._unsaid.pop(0)
            what = ("a second stop: killing every process now (each resumes from its last checkpoint or position)"
                    if killing else "stopping every process (a second Ctrl-C kills them at once)")
            self.say(f"[up] signal {signum}: {what}")
        if self.killing:
            for child in self.children:
                child.kill_now()

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
