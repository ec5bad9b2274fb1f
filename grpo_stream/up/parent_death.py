"""Children that die with the `grpo-stream up` that started them.

`up` starts each process in its own session (so a Ctrl-C in the terminal reaches `up` alone, which stops them in
order). Without more, a kill -9 of `up` (or an OOM kill, or a SIGHUP it did not handle) leaves them running: a
trainer still writing checkpoints, a Redis still holding its append-only file, and a second `up` on the same
run directory would start a second of each. Two mechanisms, each enough alone:

- `die_with_parent` (common/runtime/process.py, shared with the embedded Redis): Linux's PR_SET_PDEATHSIG, set in
  the child between fork and exec (Popen's preexec_fn), so the kernel sends SIGKILL to the child when the thread
  that started it exits. It works for any program (redis-server
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

import logging
import os
import signal
import threading
from typing import Callable

from grpo_stream.common.runtime.process import die_with_parent, set_parent_death_signal

__all__ = ["PARENT_PID_ENV", "child_env", "die_with_parent", "watch_parent"]
PARENT_PID_ENV = "GRPO_STREAM_PARENT_PID"  # set by `up` for its Python children
WATCH_EVERY_S = 1.0

log = logging.getLogger(__name__)


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
