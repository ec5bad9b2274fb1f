"""Children that die with the `grpo-stream up` that started them.

`up` starts each process in its own session (so a Ctrl-C in the terminal reaches `up` alone, which stops them in
order). Without more, a kill -9 of `up` (or an OOM kill, or a SIGHUP it did not handle) leaves them running: a
trainer still writing checkpoints, a Redis still holding its append-only file, and a second `up` on the same
run directory would start a second of each. Two mechanisms, each enough alone:

- `die_with_parent`: Linux's PR_SET_PDEATHSIG, set in the child between fork and exec (Popen's preexec_fn), so the
  kernel sends SIGKILL to the child when the thread that started it exits. It works for any program (redis-server
  too) and costs nothing while the parent lives. The parent can die between fork and prctl; then no signal will
  ever come, so the child checks its parent pid right after and kills itself if it was already re-parented.
- `watch_parent`: a Python child started by `up` (GRPO_STREAM_PARENT_PID in its environment) also polls its parent
  pid from a daemon thread and exits when it changed: the fallback where PR_SET_PDEATHSIG does not exist (not
  Linux) or was cleared.

SIGKILL, not SIGTERM: with `up` gone nobody supervises a graceful stop, and every process resumes from a kill -9
by design (the trainer from its checkpoint with exactly-once acknowledgement, Redis from its AOF).

PR_SET_PDEATHSIG fires when the *thread* that forked the child exits: `up` starts and restarts every child from its
main thread, which lives as long as `up` does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from typing import Callable

PARENT_PID_ENV = "GRPO_STREAM_PARENT_PID"  # set by `up` for its Python children
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_EVERY_S = 1.0

log = logging.getLogger(__name__)


def _load_prctl():
    """libc's prctl, resolved now (in the parent): a child between fork and exec must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
        prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4  # int prctl(int, unsigned long, ...)
        prctl.restype = ctypes.c_int
        return prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent thread exits; False where it cannot."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(parent_pid: int | None = None) -> Callable[[], None]:
    """A Popen preexec_fn: the child gets SIGKILL when this process (`parent_pid`, default: the caller) exits, and
    kills itself at once if the parent already exited between fork and this call."""
    parent = os.getpid() if parent_pid is None else parent_pid

    def _in_child() -> None:
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent:  # re-parented before the signal was armed: it would never come
            os.kill(os.getpid(), signal.SIGKILL)
    return _in_child


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a Python child of this process that should stop when this process is gone (`watch_parent`)."""
    return {**env, PARENT_PID_ENV: str(os.getpid())}


def watch_parent(environ: dict[str, str] | None = None, every_s: float = WATCH_EVERY_S,
                 on_gone: Callable[[int], None] | None = None) -> threading.Event | None:
    """In a child started by `up` (GRPO_STREAM_PARENT_PID set): arm PR_SET_PDEATHSIG again (its own start-up
    cannot race the parent's exit unnoticed: the pid is compared right after) and watch the parent pid from a
    daemon thread; when it changes, `on_gone(old pid)` (default: log and SIGKILL this process). Returns the event
    that ends the watch; None when the process was not started by `up`, or its parent already left (`on_gone`
    ran)."""
    # taken out of this process's environment: a process it starts is not `up`'s child and must not watch `up`
    raw = os.environ.pop(PARENT_PID_ENV, None) if environ is None else environ.get(PARENT_PID_ENV)
    if not raw:
        return None
    try:
        parent = int(raw)
    except ValueError:
        log.warning("$%s=%r is not a process id; not watching the parent", PARENT_PID_ENV, raw)
        return None
    gone = on_gone or _stop_now
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        gone(parent)
        return None
    stop = threading.Event()

    def _watch() -> None:
        while not stop.wait(every_s):
            if os.getppid() != parent:
                gone(parent)
                return
    threading.Thread(target=_watch, name="parent-watch", daemon=True).start()
    return stop


def _stop_now(parent: int) -> None:
    log.critical("the `grpo-stream up` that started this process (pid %d) is gone; stopping now (start `up` again "
                 "on the same run directory to resume)", parent)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
