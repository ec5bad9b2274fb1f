"""Jittered exponential back-off: waits double up to the cap, each drawn from [d/2, d], and processes that fail at
the same moment do not retry in lockstep."""

import random

import pytest

from grpo_stream.common.runtime.backoff import Backoff


def test_waits_double_to_the_cap_each_within_half_to_whole_step():
    backoff = Backoff(0.5, 4.0, rng=random.Random(0))
    steps = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    for step in steps:
        assert backoff.step_s() == step
        assert step / 2 <= backoff.next() <= step
    assert backoff.at_cap and backoff.attempts == len(steps)
    backoff.reset()
    assert backoff.attempts == 0 and backoff.step_s() == 0.5 and not backoff.at_cap


def test_samplers_failing_together_spread_their_retries():
    # 32 samplers see the trainer go away at the same instant: their first retries must not coincide
    first = [Backoff(1.0, 10.0).next() for _ in range(32)]
    assert len({round(w, 3) for w in first}) > 24 and max(first) - min(first) > 0.25
    # and the spread grows with the step: the third retries (step 4 s) cover more than a second
    third = []
    for _ in range(32):
        b = Backoff(1.0, 10.0)
        b.next(), b.next()
        third.append(b.next())
    assert max(third) - min(third) > 1.0


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(2.0, 1.0)
    for endless in (float("inf"), float("nan")):  # an infinite cap is no cap: waits that grow without bound
        with pytest.raises(ValueError, match="max_s"):
            Backoff(1.0, endless)


def test_a_wait_ends_at_once_when_the_process_is_asked_to_stop():
    """Every retry loop sleeps through `wait`: a stop (SIGTERM) must not sit out a 10 s back-off step."""
    import threading
    import time

    from grpo_stream.common.runtime.backoff import wait

    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    started = time.monotonic()
    assert wait(10.0, stop) is True and time.monotonic() - started < 2.0
    assert wait(0.01, threading.Event()) is False and wait(0.01, None) is False


def test_a_long_outage_never_waits_past_the_cap():
    """A sampler that failed ten thousand times (a trainer down for a day) waits at most max_s, not 2^n s."""
    backoff = Backoff(0.5, 30.0, random.Random(1))
    waits = [backoff.next() for _ in range(10_000)]
    assert max(waits) <= 30.0 and min(waits[-100:]) >= 15.0 and backoff.at_cap
