"""One weight fetch's lanes (grpc_transport.py GrpcFetcher): its parallel streams in the fetcher's thread pool (sized
so that every lane starts at once: weights.fetch_streams from one trainer process, or one per process of a multi-host
trainer), ended together when one fails.

A fetch that failed used to return while its other lanes kept receiving in the pool until their own deadlines
(weights rpc timeout): they held its threads, so the next attempt's lanes queued behind them and, started late, ran
past that attempt's wait and failed it too, one failure making several. So a lane registers what it opens (a gRPC
call, a data-plane socket), and when one lane fails, or none makes progress in time, the others' are cancelled and
the fetch returns only once every lane has ended: the next attempt starts on a free pool.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from typing import Any, Callable

log = logging.getLogger(__name__)


class FetchCancelled(Exception):
    """A lane stopped because another lane of its fetch failed (never the error the fetch raises)."""


def shut(sock: socket.socket) -> None:
    """End a socket's transfer from another thread: a receive blocked on it returns at once."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (OSError, ValueError):  # already closed, or never connected
        pass


class FetchLanes:
    """The lanes of one fetch attempt. `submit` runs a lane in `pool` (it gets this object as `lanes=`), `opened`
    registers how to cancel what a lane opened, `results` waits for them all (each wait for progress up to
    `wait_s`, as the lanes of a multi-host fetch may queue for the pool's threads)."""

    def __init__(self, pool: concurrent.futures.Executor, wait_s: float):
        self._pool, self.wait_s = pool, wait_s
        self._lock = threading.Lock()
        self._cancels: list[Callable[[], Any]] = []
        self._futures: list[concurrent.futures.Future] = []
        self.cancelled = False

    def submit(self, lane: Callable[..., Any], *args) -> None:
        self._futures.append(self._pool.submit(lane, *args, lanes=self))

    def opened(self, cancel: Callable[[], Any]) -> None:
        """A lane opened something that `cancel()` ends (a call's cancel, a socket's shutdown); ended at once when
        the fetch already failed."""
        with self._lock:
            if not self.cancelled:
                self._cancels.append(cancel)
                return
        cancel()

    def check(self) -> None:
        """Raises FetchCancelled once the fetch failed: a lane then starts nothing new (no fall-back call)."""
        if self.cancelled:
            raise FetchCancelled("another lane of this weight fetch failed")

    def results(self) -> list:
        """Every lane's result, in submission order; else the first lane's error (or TimeoutError when no lane ended
        within `wait_s`), raised after the other lanes were cancelled and have ended."""
        pending = set(self._futures)
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=self.wait_s,
                                                    return_when=concurrent.futures.FIRST_EXCEPTION)
            failed = next((f for f in done if f.exception() is not None), None)
            if failed is not None or not done:
                self._cancel()
                if failed is not None:
                    raise failed.exception()
                raise TimeoutError(f"weight fetch: no lane ended within {self.wait_s:g}s (the weights rpc timeout "
                                   "and a margin); cancelled")
        return [f.result() for f in self._futures]

    def abort(self) -> None:
        """End every lane from another thread, without waiting for them: what they opened is cancelled or shut, and
        one not started yet never starts."""
        with self._lock:
            self.cancelled, cancels = True, self._cancels
            self._cancels = []
        for future in list(self._futures):
            future.cancel()
        for cancel in cancels:
            cancel()

    def _cancel(self) -> None:
        self.abort()
        # a cancelled call or shut socket ends its lane at once; a connect or TLS handshake within its own timeout
        _, running = concurrent.futures.wait(self._futures, timeout=self.wait_s)
        if running:
            log.warning("weight fetch: %d lane(s) still running %gs after it was cancelled", len(running), self.wait_s)
