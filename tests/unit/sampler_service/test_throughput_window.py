"""The sampler's throughput line: a rate over the time it covers, the last minute or since the rollout stream
started, never over the gap between the window's first and last group; every group of the window counted, however
fast they are sent; the model's tokens only."""

import time
import types

import pytest

from grpo_stream.common.episodes.result import EpisodeResult, GroupWork
from grpo_stream.common.episodes.stream import GroupRun
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.sampler_service.group_sink import GroupSink, RateWindow, window_rates
from grpo_stream.sampler_service.lifecycle import SamplerMetrics


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


@pytest.mark.parametrize("groups_per_s", [50, 200, 400])
def test_the_reported_rate_is_the_rate_sent_however_fast_and_memory_stays_within_the_window(groups_per_s):
    """The window kept the last 4096 groups: every rate above 4096 / 60 s read 68 groups/s on the trainer's status
    and the console line."""
    rate, t = RateWindow(), 0.0
    while t < 120.0:  # two minutes of steady sending, 100 tokens a group
        rate.add(t, 100)
        t += 1.0 / groups_per_s
    groups_s, tokens_s, span = rate.rates(now=120.0, since=0.0)
    assert span == 60.0 and groups_s == pytest.approx(groups_per_s, rel=0.01)
    assert tokens_s == pytest.approx(100 * groups_per_s, rel=0.01)
    assert len(rate._events) <= 60 * groups_per_s + 2  # older groups are let go


def test_tokens_generated_count_the_model_s_tokens_not_an_environment_s_observations():
    """A multi-turn episode holds the observations an environment wrote between the model's turns: they were not
    generated, and counting them inflated tokens/s and the summary's tokens_generated."""
    client = types.SimpleNamespace(put=lambda message, timeout_s, **kw: True)
    sink = GroupSink(client, SamplerMetrics("s"), types.SimpleNamespace(decode=lambda ids: "3"), "s", 0.0,
                     lambda: False, types.SimpleNamespace(call=lambda *a: 1.0, close=lambda: None))
    work = GroupWork(types.SimpleNamespace(prompt_id="p", answer="3"), [1, 2], 2, RewardSet({"answer_correct": 1.0}),
                     "run/sampler-0/0", 0, None)
    run = GroupRun(work, None, 0)
    for row in range(2):
        result = EpisodeResult()
        result.add_turn([3, 4, 5], [-0.1] * 3, [0] * 3, True)
        result.add_observation([7] * 20)  # the environment's answer
        result.add_turn([6], [-0.1], [0], True)
        run.results[row] = result
    sink.put(run)
    sink.close()
    assert sink.groups_sent == 1 and sink.tokens_generated == 2 * 4
    assert sink.rate.rates(time.monotonic(), time.monotonic() - 60)[1] == pytest.approx(8 / 60)
