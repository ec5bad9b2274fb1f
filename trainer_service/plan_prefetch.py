"""The next step's plan made on a worker thread while the main thread applies the current one (trainer.prefetch_plans).

A trainer step's host work (reading its groups from the buffer, building and packing its batch: numpy and Redis)
needs nothing the update computes, and the update's compute releases the GIL; done on the main thread it sits between
two updates. `PlanPrefetch` runs it for step n+1 on a thread of its own (`plan-prefetch`) as soon as plan n is handed
to the core, and the main thread takes it when step n is done (plan_sources.py).

What does not change: a plan is made for the step that trains it (`prepare(n + 1)`: the collector judges staleness
against version n, the one step n+1 trains), plans are sent to the other processes and applied in order by the main
thread only, and a prepared plan that is never taken (the run stops, or fails) leaves its groups unacknowledged in the
buffer, where a resumed trainer reads them again (checkpoints/durability.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, Generic, TypeVar

from grpo_stream.trainer_service.daemon_worker import DaemonWorker

log = logging.getLogger(__name__)
T = TypeVar("T")
ABANDON_WAIT_S = 2.0  # after a failure: how long to wait for a prefetch to see its cancel before leaving it


class PlanPrefetch(Generic[T]):
    """At most one `prepare(key, cancel)` ahead, on one daemon thread started with the first: a prefetch stuck on the
    buffer (Redis away) must not keep a failed process from exiting. One thread for the run, not one a step: starting
    a thread makes the caller wait until it runs, which on a busy machine is main-thread time."""

    def __init__(self, prepare: Callable[[int, threading.Event], T], enabled: bool):
        """`prepare(key, cancel)`: the plan for `key` (a step), or whatever the source makes of it; it should return
        soon once `cancel` is set. `enabled` false: every plan is made by `take`, on the caller's thread."""
        self.prepare, self.enabled = prepare, enabled
        self.cancel = threading.Event()
        self.main_waits = False  # the main thread waits in `take` (plan_sources.py: heartbeats only then)
        self._key: int | None = None
        self._future: concurrent.futures.Future | None = None
        self._worker = DaemonWorker("plan-prefetch")

    def submit(self, key: int) -> None:
        """Start preparing `key` on the worker thread (nothing when disabled)."""
        if not self.enabled:
            return
        if self._future is not None:
            raise RuntimeError(f"plan prefetch: {key} submitted while {self._key} was not taken")
        # what it raises is re-raised on the main thread by take/close
        self._key, self._future = key, self._worker.submit(self.prepare, key, self.cancel)

    def take(self, key: int) -> tuple[T, bool]:
        """(what `prepare(key)` returned, whether it was made ahead): the worker's result (waiting for it; its
        exception re-raised here), or made now on this thread when nothing was submitted."""
        future, self._future = self._future, None
        self.main_waits = True
        try:
            if future is None:
                return self.prepare(key, self.cancel), False
            if self._key != key:
                raise RuntimeError(f"plan prefetch: {self._key} was prepared, {key} is wanted")
            return future.result(), True
        finally:
            self.main_waits = False

    def close(self, failed: bool) -> None:
        """Cancel what is still being prepared and end the worker. After a normal end (a stop) wait for both and
        re-raise what the prefetch raised, so its errors are never lost and nothing of it still runs when the source
        makes its finish plan; after a failure (`failed`) wait `ABANDON_WAIT_S` at most and only log its error."""
        self.cancel.set()
        self._worker.shutdown(wait=False)  # the worker ends after what it prepares
        future, self._future = self._future, None
        try:
            if future is not None and not failed:
                started = time.monotonic()
                future.result()  # what it made is not applied: its groups stay in the buffer, unacknowledged
                log.info("plan prefetch of step %s ended unapplied (%.2fs after the stop)", self._key,
                         time.monotonic() - started)
            elif future is not None:
                try:
                    future.result(timeout=ABANDON_WAIT_S)
                except concurrent.futures.TimeoutError:
                    log.warning("plan prefetch of step %s still running %.0fs after a failure: left behind",
                                self._key, ABANDON_WAIT_S)
                except BaseException as exc:  # noqa: BLE001 - the main thread's failure is the one reported
                    log.error("plan prefetch of step %s failed too: %s: %s", self._key, type(exc).__name__, exc)
        finally:
            self._worker.shutdown(timeout=ABANDON_WAIT_S if failed else None)
