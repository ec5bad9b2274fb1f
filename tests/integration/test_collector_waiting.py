"""A trainer step that cannot get its groups says why, over a real Redis buffer: every group without reward variance
(algo.dynamic_sampling drops them all), or no group at all (the samplers are gone). Before, the first spun for ever
without a word and the waiting note counted the groups it was about to drop as the step's ("2/2 groups")."""

import logging
import threading

import numpy as np
import pytest

from grpo_stream.common.rollouts.buffer import Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.wire import CompletionData, GroupData, GroupLimits, encode_group
from grpo_stream.trainer_service.learning import collector as collector_module
from grpo_stream.trainer_service.learning.collector import FLAT_WARN_STEPS, GroupCollector
from grpo_stream.trainer_service.loop import sampler_contact

pytestmark = pytest.mark.redis
LIMITS = GroupLimits(num_generations=2, max_prompt_tokens=8, max_new_tokens=6, vocab_size=50)
LOGGER = collector_module.__name__


def group(i: int, rewards=(1.0, 1.0)) -> Incoming:
    comps = [CompletionData(np.arange(5, 7, dtype=np.int32), np.full(2, -0.1, np.float32), r, False) for r in rewards]
    data = GroupData(f"run/s0/{i}", f"p{i}", np.array([1, 2, 3], np.int32), comps, 0, "s0", data_position=i)
    return Incoming(data.group_id, "s0", 0, i, encode_group(data))


def stopping_when_empty(buffer, stop: threading.Event):
    """buffer.read that sets `stop` once nothing is left (a stop after the trainer met an empty buffer, not on a
    timer, which a loaded machine could reach first)."""
    read = buffer.read

    def read_then_stop(max_count, block_ms):
        entries = read(max_count, block_ms=0)
        if not entries:
            stop.set()
        return entries

    return read_then_stop


def collector(buffer, need: int, stop: threading.Event, **extra) -> GroupCollector:
    buffer.read = stopping_when_empty(buffer, stop)
    return GroupCollector(buffer, need, 4, lambda g: np.ptp(g.rewards) == 0, stop, held=lambda: 0, limits=LIMITS,
                          **extra)


def test_groups_all_without_signal_are_named_with_the_setting_that_drops_them(shared_redis, run_name, caplog):
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    need = 2
    buffer.append_many([group(i) for i in range(FLAT_WARN_STEPS * need + 1)], max_groups=1000)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert collector(buffer, need, threading.Event()).collect(step=1) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("zero reward variance" in w and "algo.dynamic_sampling=false" in w for w in warnings), warnings
    assert buffer.counters()["dropped_filtered"] == FLAT_WARN_STEPS * need + 1


def test_a_usable_group_resets_the_zero_variance_count(shared_redis, run_name, caplog):
    """Groups with signal now and then (a hard task): no warning however many flat ones there are in all."""
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    need = 2
    stream = []
    for i in range(3 * FLAT_WARN_STEPS * need):
        stream.append(group(i, rewards=(0.0, 1.0) if i % (FLAT_WARN_STEPS * need - 1) == 0 else (1.0, 1.0)))
    buffer.append_many(stream, max_groups=1000)
    c = collector(buffer, need, threading.Event())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        steps = [c.collect(step=1), c.collect(step=1)]
    assert all(s is not None and len(s) == need for s in steps)
    assert not [r for r in caplog.records if "zero reward variance" in r.getMessage()]


def test_the_waiting_note_counts_usable_groups_not_the_ones_it_drops(shared_redis, run_name, caplog, monkeypatch):
    monkeypatch.setattr(collector_module, "NOTE_EVERY_S", -1.0, raising=False)  # a note on every pass
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    buffer.append_many([group(i) for i in range(3)], max_groups=100)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert collector(buffer, 2, threading.Event()).collect(step=1) is None
    notes = [r.getMessage() for r in caplog.records if "waiting for rollouts" in r.getMessage()]
    assert notes and "0/2 usable groups" in notes[-1] and "3 zero-variance" in notes[-1], notes
    assert not any("2/2" in n for n in notes), notes


def test_a_trainer_that_gets_no_groups_says_what_to_check(shared_redis, run_name, caplog, monkeypatch):
    monkeypatch.setattr(collector_module, "NOTE_EVERY_S", -1.0, raising=False)
    monkeypatch.setattr(collector_module, "QUIET_WARN_S", 0.0, raising=False)  # warn at once
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    c = collector(buffer, 2, threading.Event(), samplers=lambda: sampler_contact([]))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert c.collect(step=1) is None
    messages = [r.getMessage() for r in caplog.records]
    assert any("samplers: none has reported to this trainer" in m for m in messages), messages
    assert any("no group arrived" in m and "`grpo-stream status`" in m and "redis.url" in m for m in messages)


def test_sampler_contact_says_how_long_ago_the_samplers_reported():
    rows = [{"last_seen_unix": 100.0}, {"last_seen_unix": 40.0}]
    assert sampler_contact(rows, now=130.0) == "2 known, the latest report 30s ago, the oldest 90s ago"
