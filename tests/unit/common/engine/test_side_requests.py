"""The side queue's rules (logic only; the engines serve it for real in tests/integration/test_openai_endpoint.py
and the vLLM endpoint check): a request is drawn by the weights installed when it is served; the sampler's own serve
takes endpoint requests only while its own work is unfinished, so endpoint traffic never keeps its batch from ending;
an idle serve stops taking them when the sampler wants the engine; what is inside the engine stays bounded; a
refused request queues none of its sequences."""

import numpy as np
import pytest

from grpo_stream.common.engine.base import FixedRequests, Generation, Request
from grpo_stream.common.engine.side_requests import MergedSource, NoRequests, QueueFull, SideQueue, SideRequest


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
    source = MergedSource(NoRequests(), queue, greedy=False, version=1, idle=True, current=lambda: installed[0])
    installed[0] = (None, 2)  # the sampler installed version 2 while this serve lingered
    assert source.take() == [] and not source.open() and queue.has()
    fresh = MergedSource(NoRequests(), queue, greedy=False, version=2, idle=True, current=lambda: installed[0])
    assert len(fresh.take()) == 1


def test_the_samplers_serve_takes_endpoint_requests_only_while_its_own_rows_run():
    queue = SideQueue(8)
    source = MergedSource(own_rows(2), queue, greedy=False, version=0)
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
    assert MergedSource(NoRequests(), queue, greedy=False, version=0, idle=True).take() == []


def test_what_is_inside_the_engine_stays_bounded_and_a_refused_request_queues_nothing():
    queue = SideQueue(2)
    with pytest.raises(QueueFull):
        queue.submit(side(3))
    assert not queue.has()
    queue.submit(side(2))
    assert len(queue.take(False)) == 2
    queue.submit(side(2))
    assert queue.take(False) == []  # 2 inside the engine already
    queue.left_engine(1)
    assert len(queue.take(False)) == 1
