"""Requests from outside a sampler's own work (its OpenAI-compatible endpoint) served by the same engine, in the
same continuous batch.

A sampler's engine is busy with its own rollout stream most of the time, and a second engine would need a second
copy of the weights. So an endpoint request is queued here (`SideQueue.submit`), and whichever `serve` runs takes it:
- while the sampler's stream runs (from its first weights to its last), its `serve` takes queued requests at every
  scheduling point beside its own rows (`merged`): they share the engine, the weights and the weight version of the
  sampler's work, each sampling its own way (greedy or at the policy's temperature, per request);
- before the stream starts or after it ends (or in a process whose engine has no stream), an idle server
  (`serve_idle`, a thread of the endpoint) runs `serve` over queued requests alone, with the weights installed then.
The engine runs one `serve` at a time (`SideQueue.engine`, a lock). An idle serve stops taking requests as soon as
the sampler asks for the engine, so the sampler waits at most for the requests already decoding.

Outside sequences inside the engine (taken by a serve, decoding or waiting for a slot) are at most `max_in_engine`
(sampler.openai.max_engine_share of the engine's slots): however many a client queues, the sampler's own rows always
have the other slots, and a serve of a fixed request set (`generate`) waits for at most that many outside sequences
before it ends. A sequence whose caller went away (`withdraw`) leaves the queue, and one already taken stops at the
engine's next scheduling point (`MergedSource.withdrawn`), freeing its slot instead of decoding for nobody.

A request may belong to one of the sampler's own rollouts (`owned`: a `verifiers` environment's model call): while a
sampler drains its stream for a weight install it takes only those (they are part of the groups it waits for), and
outside requests wait for the new version.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from grpo_stream.common.engine.base import FixedRequests, Request

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.02  # how often a waiting serve looks for endpoint requests (their added latency at most)
# an idle serve stays open this long after its last request came, so the next turn of a conversation (a client's
# round trip away) joins it instead of starting a serve of its own (each serve lays the weights out anew)
IDLE_LINGER_S = 0.25


class QueueFull(RuntimeError):
    """The endpoint's queue holds as many requests as it may (sampler.openai.max_queued)."""


@dataclasses.dataclass(eq=False)
class SideRequest:
    """One sequence an endpoint asked for, and, once `done` is set, its result."""
    ids: list[int]
    budget: int
    key: Any                         # the engine's per-sequence key (engine.request_keys)
    greedy: bool = False
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False           # ended at a stop token (else at its budget)
    version: int = -1                # the weight version that drew its last token
    error: str | None = None         # the engine failed: no tokens
    notify: Callable[[], None] | None = None  # called (on the engine's thread) once it is done
    cancelled: bool = False          # its caller went away: not started if it has not been
    owned: bool = False              # made by one of the sampler's own rollouts (a verifiers episode's model call)
    versions: list[int] = dataclasses.field(default_factory=list)  # per token: the weight version that drew it

    def complete(self) -> None:
        self.done.set()
        if self.notify is not None:
            try:
                self.notify()
            except RuntimeError:  # the caller's event loop is closed (the endpoint is stopping): nobody waits
                pass


class SideQueue:
    """Endpoint requests waiting for the engine, and the engine's lock. Thread-safe."""

    def __init__(self, max_queued: int, max_in_engine: int | None = None):
        """`max_queued`: outside sequences waiting; `max_in_engine`: outside sequences taken by a serve and not
        finished (None: max_queued), a share of the engine's slots so that the sampler's own rows keep the rest."""
        self.max_queued = max_queued
        self.max_in_engine = max_in_engine or max_queued
        self.engine = threading.Lock()             # one serve at a time, the sampler's or an idle one
        self.sampler_waiting = threading.Event()   # the sampler wants the engine: idle serves take nothing more
        self._waiting: collections.deque[SideRequest] = collections.deque()
        self._cond = threading.Condition()
        self.in_engine = 0                         # outside requests taken by a serve, not finished
        self.served = 0                            # requests finished (figures)
        self.served_in_sampler_batches = 0         # ... of which inside the sampler's own serves

    def submit(self, requests: list[SideRequest]) -> None:
        """Queue all of `requests` or none: QueueFull when outside requests would pass max_queued waiting (the
        process's own rollouts' are never refused: the rollout stream bounds them)."""
        with self._cond:
            waiting, coming = sum(not r.owned for r in self._waiting), sum(not r.owned for r in requests)
            if coming and waiting + coming > self.max_queued:
                raise QueueFull(f"{waiting} sequences are waiting and this request brings "
                                f"{coming} (sampler.openai.max_queued={self.max_queued})")
            self._waiting.extend(requests)
            self._cond.notify_all()

    def requeue(self, requests: list[SideRequest]) -> None:
        """Requests a serve took and did not finish: waiting again, first, and no longer inside the engine."""
        with self._cond:
            self.in_engine -= sum(not r.owned for r in requests)
            self._waiting.extendleft(reversed([r for r in requests if not r.cancelled]))
            self._cond.notify_all()

    def withdraw(self, requests: list[SideRequest]) -> None:
        """Their caller went away: those still waiting leave the queue; those a serve has taken are stopped by it at
        its next scheduling point (MergedSource.withdrawn), never handed back."""
        with self._cond:
            for r in requests:
                r.cancelled = True
                if r in self._waiting:
                    self._waiting.remove(r)

    def has(self, owned_only: bool = False) -> bool:
        with self._cond:
            return any(r.owned or not owned_only for r in self._waiting)

    def wait_for(self, timeout: float, owned_only: bool = False) -> bool:
        """Block until a request waits (`owned_only`: one of the sampler's own rollouts'), or `timeout` passes."""
        with self._cond:
            if not any(r.owned or not owned_only for r in self._waiting):
                self._cond.wait(timeout)
            return any(r.owned or not owned_only for r in self._waiting)

    def take(self, owned_only: bool = False) -> list[SideRequest]:
        """Waiting requests, oldest first (`owned_only`: the sampler's own rollouts' only): outside requests while
        fewer than max_in_engine are inside the engine (the engine's own list of pending rows stays bounded too, and
        the sampler's rows keep the other slots); the process's own rollouts' always (their number is the rollout
        stream's to bound)."""
        with self._cond:
            room = max(0, self.max_in_engine - self.in_engine)
            taken = []
            for r in self._waiting:
                if r.owned:
                    taken.append(r)
                elif not owned_only and room > 0:
                    taken.append(r)
                    room -= 1
            for r in taken:
                self._waiting.remove(r)
            self.in_engine += sum(not r.owned for r in taken)
        return taken

    def left_engine(self, requests: list[SideRequest]) -> None:
        with self._cond:
            self.in_engine -= sum(not r.owned for r in requests)

    def fail_waiting(self, why: str) -> None:
        """End every waiting request with an error (the sampler is stopping)."""
        with self._cond:
            failed, self._waiting = list(self._waiting), collections.deque()
        for r in failed:
            r.error = why
            r.complete()

    @contextlib.contextmanager
    def sampler_turn(self) -> Iterator[None]:
        """The sampler's hold on the engine: an idle serve running now stops taking requests and ends when its
        requests are done."""
        self.sampler_waiting.set()
        with self.engine:
            self.sampler_waiting.clear()
            yield


class MergedSource:
    """A serve's own request source plus the endpoint's queued requests (see the module docstring). `idle`: a serve
    of endpoint requests only, which stops taking them once the sampler waits for the engine."""

    def __init__(self, inner, side: SideQueue, version: int, idle: bool = False,
                 current: Callable[[], tuple[Any, int]] | None = None):
        """`current`: an idle serve's source of the installed weights; it takes nothing once they are newer than
        its own (a request must be drawn by the version installed when it is served)."""
        self.inner, self.side, self.version, self.idle, self.current = inner, side, version, idle, current
        self._live: set[SideRequest] = set()  # taken by the engine, not finished yet
        self._own_live = 0  # the serve's own requests taken and not finished
        self._last_taken = time.monotonic()

    def _may_take(self) -> bool:
        """An idle serve takes endpoint requests until the sampler wants the engine; the sampler's own serve while
        its own work is unfinished (so endpoint traffic can never keep a finite request set from ending)."""
        if self.idle:
            return not self.side.sampler_waiting.is_set() and (self.current is None or
                                                               self.current()[1] == self.version)
        return self._own_live > 0 or self.inner.open()

    def take(self) -> list[Request]:
        taken = self.inner.take()
        self._own_live += len(taken)
        if self._may_take():
            side = self.side.take(owned_only=not self.inner.accepting())
            if side:
                self._last_taken = time.monotonic()
            self._live.update(side)
            taken += [Request(ids=r.ids, budget=r.budget, key=r.key, tag=r, greedy=r.greedy) for r in side]
        return taken

    def withdrawn(self) -> set[SideRequest]:
        """Endpoint requests taken by this serve whose caller went away since (SideQueue.withdraw): out of the
        engine's count now; the engine frees their rows and slots without handing them back."""
        gone = {r for r in self._live if r.cancelled}
        if gone:
            self._live -= gone
            self.side.left_engine(list(gone))
        return gone

    def requeue_live(self) -> None:
        """The serve ended with endpoint requests unfinished (its own source was cancelled: the sampler is stopping or
        past its final version): they go back to the front of the queue for the next serve, from their start."""
        self.side.requeue(list(self._live))
        self._live.clear()

    def fail_live(self, why: str) -> None:
        """The serve failed: end the endpoint requests it had taken with an error (their callers are waiting)."""
        for r in self._live:
            r.error = why
            r.complete()
        self.side.left_engine(list(self._live))
        self._live.clear()

    def finish(self, request: Request, tokens, logprobs, versions, finished: bool) -> None:
        side = request.tag
        if not isinstance(side, SideRequest):
            self._own_live -= 1
            self.inner.finish(request, tokens, logprobs, versions, finished)
            return
        side.tokens = np.asarray(tokens).tolist()
        side.logprobs = np.asarray(logprobs, np.float32).tolist()
        side.finished = bool(finished)
        side.versions = (np.asarray(versions).tolist() if versions is not None and len(versions)
                         else [self.version] * len(side.tokens))
        side.version = side.versions[-1] if side.versions else self.version
        self.side.served += 1
        self.side.served_in_sampler_batches += not self.idle
        self._live.discard(side)
        self.side.left_engine([side])
        side.complete()

    def open(self) -> bool:
        if self.idle:
            return self._may_take() and time.monotonic() - self._last_taken < IDLE_LINGER_S
        return self.inner.open()

    def accepting(self) -> bool:
        return self.inner.accepting()

    def released(self) -> list:
        return self.inner.released()

    def cancelled(self) -> bool:
        return self.inner.cancelled()

    def wait(self, timeout: float) -> None:
        if self.idle:  # nothing of its own to wait for: the next endpoint request, or the end of the linger
            linger = IDLE_LINGER_S - (time.monotonic() - self._last_taken)
            self.side.wait_for(max(0.0, min(timeout, linger)))
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._may_take() and self.side.has(owned_only=not self.inner.accepting()):
                return
            self.inner.wait(min(IDLE_POLL_S, max(0.0, deadline - time.monotonic())))
            if not self.inner.open() or self.inner.cancelled():
                return


class NoRequests(FixedRequests):
    """The own source of an idle serve: nothing, and closed (the serve ends when the endpoint's requests do)."""

    def __init__(self):
        super().__init__([], None)

    def finish(self, request, tokens, logprobs, versions, finished) -> None:
        raise AssertionError("an idle serve has no requests of its own")


# an engine's serve of one source with no endpoint requests joining it: (params, source, refresh, version)
ServeAlone = Callable[[Any, Any, Any, int], None]


def serve_sharing(side: SideQueue | None, serve_alone: ServeAlone, params: Any, source, refresh: Callable | None,
                  version: int) -> None:
    """An engine's `serve`: `serve_alone` (its serve of one source) run under the side queue's lock over `source`
    and the queue's requests; with no side queue attached (`side` None), `serve_alone` over `source`."""
    if side is None:
        return serve_alone(params, source, refresh, version)
    with side.sampler_turn():
        serve_merged(serve_alone, params, MergedSource(source, side, version), refresh, version)


def serve_merged(serve_alone: ServeAlone, params, merged: MergedSource, refresh, version: int) -> None:
    try:
        serve_alone(params, merged, refresh, version)
    except BaseException as exc:
        merged.fail_live(f"the engine failed: {type(exc).__name__}: {exc}"[:300])
        raise
    merged.requeue_live()  # a cancelled source ends the serve with endpoint requests still decoding


def serve_idle(engine, side: SideQueue, current: Callable[[], tuple[Any, int]], stop: threading.Event) -> None:
    """Serve endpoint requests while the sampler leaves the engine alone, until `stop` (a thread's body).
    `current()`: the installed (params, version); (None, -1) before the first weights, when requests wait."""
    while not stop.is_set():
        if not side.wait_for(0.1):
            continue
        if side.sampler_waiting.is_set() or not side.engine.acquire(timeout=IDLE_POLL_S):
            stop.wait(IDLE_POLL_S)  # the sampler's turn: its serve takes the requests
            continue
        params = None
        try:
            params, version = current()  # read under the lock: the weights installed now, not before a wait
            if params is None:  # no weights yet: requests wait for the first version
                continue
            if side.has() and not side.sampler_waiting.is_set():
                serve_merged(engine.serve_alone, params,
                             MergedSource(NoRequests(), side, version, idle=True, current=current),
                             None, version)
        except Exception as exc:  # noqa: BLE001 - its requests were answered with the error; the endpoint goes on
            log.exception("serving endpoint requests failed")
            # and those still waiting too: an engine that fails before it takes any (a vLLM engine broken by an
            # install that failed part-way refuses every serve) would have them retried every 0.1 s for ever
            side.fail_waiting(f"the engine failed: {type(exc).__name__}: {exc}"[:300])
        finally:
            side.engine.release()
            if params is None:
                stop.wait(0.1)
