"""The sampler's throughput line: a rate over the time it covers, the last minute or since the rollout stream
started, never over the gap between the window's first and last group."""

import pytest

from grpo_stream.sampler_service.group_sink import window_rates


def test_two_groups_sent_together_after_100_s_are_not_two_groups_a_second():
    # the first line of a slow run: 2 groups of 30 tokens, both sent at the 100th second of the stream
    events = [(99.9, 30), (100.0, 30)]
    groups_s, tokens_s, span = window_rates(events, now=100.0, since=0.0)
    assert span == 60.0 and groups_s == pytest.approx(2 / 60) and tokens_s == pytest.approx(60 / 60)


def test_a_stream_younger_than_the_window_is_measured_since_it_started():
    events = [(5.0, 10), (10.0, 10), (19.0, 10)]
    groups_s, tokens_s, span = window_rates(events, now=20.0, since=0.0)
    assert span == 20.0 and groups_s == pytest.approx(3 / 20) and tokens_s == pytest.approx(30 / 20)


def test_groups_older_than_the_window_are_left_out():
    events = [(t, 1) for t in range(0, 200, 10)]  # one group every 10 s
    groups_s, _, span = window_rates(events, now=195.0, since=0.0)
    assert span == 60.0 and groups_s == pytest.approx(6 / 60)  # 140, 150, ..., 190
    assert window_rates([], now=195.0, since=0.0)[:2] == (0.0, 0.0)
