"""Calls given up on (common/runtime/given_up.py): an answer in time is returned, a raise is raised here, a call past
its time is given up and left running; and the threads left running are capped, so a dependency that never returns
cannot make a process pile up threads without bound."""

from __future__ import annotations

import threading

import pytest

from grpo_stream.common.runtime.given_up import GivenUp, TooManyGivenUp, call_within, given_up_count


def test_an_answer_in_time_is_returned_and_a_raise_raised_here():
    assert call_within(lambda: 7, 5.0, "quick") == 7
    with pytest.raises(KeyError):
        call_within(lambda: {}["x"], 5.0, "raises")


def test_given_up_threads_are_capped_with_an_error_naming_the_call_that_hangs():
    release = threading.Event()
    before = given_up_count()
    try:
        for _ in range(2):
            with pytest.raises(GivenUp):
                call_within(release.wait, 0.0, "tool-hangs", limit=before + 2)
        assert given_up_count() == before + 2
        started = threading.Event()
        with pytest.raises(TooManyGivenUp) as refused:
            call_within(started.set, 5.0, "tool-next", limit=before + 2)
        assert not started.is_set()  # refused before another thread was started
        assert "tool-hangs" in str(refused.value) and "still running" in str(refused.value)
    finally:
        release.set()
    for thread in threading.enumerate():
        if thread.name == "tool-hangs":
            thread.join()
    assert given_up_count() == before  # once they return they no longer count
    assert call_within(lambda: 1, 5.0, "tool-next", limit=before + 2) == 1
