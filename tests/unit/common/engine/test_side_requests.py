"""The side queue's rules (logic only; the engines serve it for real in tests/integration/test_openai_endpoint.py
and the vLLM endpoint check): a request is drawn by the weights installed when it is served; a serve of a fixed
request set takes endpoint requests only while its own work is unfinished, so endpoint traffic never keeps it from
ending; an idle serve stops taking them when the sampler wants the engine; what is inside the engine stays bounded; a
refused request queues none of its sequences; each request keeps its own sampling mode; while the sampler drains its
stream only its own rollouts' requests are taken, and those are never refused nor bounded by the endpoint's limits."""

import threading

import numpy as np
import pytest

from grpo_stream.common.engine.base import FixedRequests, Generation, Request
from grpo_stream.common.engine.side_requests import (MergedSource, NoRequests, QueueFull, SideQueue, SideRequest,
                                                     serve_idle)


def side(n: int = 1) -> list[SideRequest]:
    return [SideRequest(ids=[1, 2], budget=2, key=0) for _ in range(n)]


def own_rows(rows: int) -> FixedRequests:
    out = Generation(np.zeros((rows, 2), np.int32), np.zeros((rows, 2), np.float32), np.zeros(rows, np.int32),
                     np.zeros(rows, np.bool_))
    return FixedRequests([Request([1], 2, 0, i) for i in range(rows)], out)


def test_an_idle_serve_takes_nothing_once_newer_weights_are_installed():
    queue = SideQueue(8)
    queue.submit(side())
    installed = [(None, 1)]
    source = MergedSource(NoRequests(), queue, version=1, idle=True, current=lambda: installed[0])
    installed[0] = (None, 2)  # the sampler installed version 2 while this serve lingered
    assert source.take() == [] and not source.open() and queue.has()
    fresh = MergedSource(NoRequests(), queue, version=2, idle=True, current=lambda: installed[0])
    assert len(fresh.take()) == 1


def test_the_samplers_serve_takes_endpoint_requests_only_while_its_own_rows_run():
    queue = SideQueue(8)
    source = MergedSource(own_rows(2), queue, version=0)
    queue.submit(side())
    first = source.take()
    assert len(first) == 3  # its 2 rows and the endpoint's
    for request in first:
        source.finish(request, [5], [-0.5], None, True)
    queue.submit(side())
    assert source.take() == [] and not source.open()  # its rows are done: the serve can end
    assert queue.has() and queue.served_in_sampler_batches == 1


def test_an_idle_serve_stops_taking_when_the_sampler_waits():
    queue = SideQueue(8)
    queue.submit(side())
    queue.sampler_waiting.set()
    assert MergedSource(NoRequests(), queue, version=0, idle=True).take() == []


def test_what_is_inside_the_engine_stays_bounded_and_a_refused_request_queues_nothing():
    queue = SideQueue(2)
    with pytest.raises(QueueFull):
        queue.submit(side(3))
    assert not queue.has()
    queue.submit(side(2))
    taken = queue.take()
    assert len(taken) == 2
    queue.submit(side(2))
    assert queue.take() == []  # 2 inside the engine already
    queue.left_engine(taken[:1])
    assert len(queue.take()) == 1


class Draining(FixedRequests):
    """A fixed request set that, like a sampler draining its stream for a weight install, takes no outside work."""

    def accepting(self) -> bool:
        return False


def test_requests_keep_their_own_sampling_mode_and_a_drain_takes_only_the_samplers_own():
    queue = SideQueue(1)
    greedy, sampled = SideRequest(ids=[1], budget=2, key=0, greedy=True), SideRequest(ids=[2], budget=2, key=1)
    owned = [SideRequest(ids=[3], budget=2, key=2, owned=True) for _ in range(3)]
    queue.submit([greedy])
    queue.submit(owned)  # the sampler's own rollouts: beyond max_queued, never refused
    with pytest.raises(QueueFull):
        queue.submit([sampled])
    source = MergedSource(Draining([], own_rows(1).out), queue, version=0)
    source.inner.requests = own_rows(1).requests
    taken = source.take()
    assert [r.tag for r in taken[1:]] == owned  # draining: the outside (greedy) request waits
    assert queue.has() and not queue.has(owned_only=True)
    for request in taken:
        source.finish(request, [5, 6], [-0.1, -0.2], np.array([3, 4]), True)
    assert [r.versions for r in owned] == [[3, 4]] * 3 and all(r.version == 4 for r in owned)
    assert queue.in_engine == 0  # owned requests never counted against the endpoint's bound
    free = MergedSource(own_rows(1), queue, version=0)
    (_, request), = [(r, r) for r in free.take() if r.tag is greedy]
    assert request.greedy


def test_endpoint_requests_a_cancelled_serve_leaves_unfinished_wait_for_the_next_one():
    """The sampler stops (or passes its final version) while endpoint requests decode in its stream's serve: they go
    back to the front of the queue, out of the engine's count, for the idle serve to answer from their start."""
    queue = SideQueue(4)
    first, second = side(2)
    queue.submit([first])
    source = MergedSource(own_rows(1), queue, version=0)
    assert [r.tag for r in source.take()[1:]] == [first] and queue.in_engine == 1
    queue.submit([second])
    source.requeue_live()
    assert queue.in_engine == 0 and queue.take() == [first, second]


def test_outside_sequences_inside_the_engine_stay_within_their_share_of_slots():
    """However many sequences a client queues, a serve takes at most max_in_engine of them (a share of the engine's
    slots); the sampler's own rollouts' requests are never held back by that bound."""
    queue = SideQueue(256, max_in_engine=4)
    queue.submit(side(64))
    owned = SideRequest(ids=[3], budget=2, key=2, owned=True)
    queue.submit([owned])
    taken = queue.take()
    assert sum(not r.owned for r in taken) == 4 and owned in taken
    assert queue.take() == []
    queue.left_engine(taken[:1])
    assert len(queue.take()) == 1


def test_a_withdrawn_request_a_serve_took_leaves_the_engines_count():
    queue = SideQueue(8)
    mine, other = side(2)
    queue.submit([mine, other])
    source = MergedSource(own_rows(1), queue, version=0)
    source.take()
    assert queue.in_engine == 2 and source.withdrawn() == set()
    queue.withdraw([mine])
    assert source.withdrawn() == {mine} and queue.in_engine == 1
    assert source.withdrawn() == set()  # reported once
    source.requeue_live()
    assert queue.take() == [other]  # the withdrawn one is not served again


def test_an_idle_serve_whose_engine_fails_before_taking_anything_answers_the_waiting_requests():
    """A broken engine (a vLLM install that failed part-way) refuses every serve before it takes a request: the idle
    serve retried every 0.1 s, logging each failure, and the endpoint's callers waited for ever."""
    class Broken:
        def serve_alone(self, params, source, refresh, version):
            raise RuntimeError("the vLLM engine's model mixes two versions")

    queue, stop = SideQueue(8), threading.Event()
    waiting = side(2)
    queue.submit(waiting)
    thread = threading.Thread(target=serve_idle, args=(Broken(), queue, lambda: ("params", 1), stop), daemon=True)
    thread.start()
    try:
        assert all(r.done.wait(10) for r in waiting)
        assert all("mixes two versions" in r.error for r in waiting) and not queue.has()
    finally:
        stop.set()
        thread.join(10)
