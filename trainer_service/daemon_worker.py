"""`DaemonWorker`: the one-thread, in-order executor under the trainer's background jobs (core.py: publications,
step reports, step books; plan_prefetch.py: the next step's plan). A daemon thread, so a job stuck on something
outside the process (a storage, Redis, a tracker) never keeps a process that failed from exiting."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class DaemonWorker:
    """Jobs run one at a time, in order, on one daemon thread started with the first. Not a
    ThreadPoolExecutor(max_workers=1): the interpreter joins its workers at exit whatever `shutdown(wait=False)`
    said, so one job stuck outside the process (a transfer, a Redis that is gone, a tracker) kept a failed process,
    which had its error to report, from ever exiting."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[..., T], *args) -> concurrent.futures.Future:
        """The future of `fn(*args)`, run after the jobs submitted before it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.name} worker is shut down: no new job is taken")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
            self._work.put((future, fn, args))
        return future

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            future, fn, args = work
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - the future's waiter re-raises it
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False, timeout: float | None = None) -> None:
        """Take no more jobs; `cancel_futures`: cancel those not started; `wait`: until the thread ends (at most
        `timeout` seconds), else leave it to end after its job."""
        with self._lock:
            self._closed = True
            while cancel_futures:
                try:
                    work = self._work.get_nowait()
                except queue.Empty:
                    break
                if work is not None:
                    work[0].cancel()
            self._work.put(None)
        if wait and self._thread is not None:
            self._thread.join(timeout)
