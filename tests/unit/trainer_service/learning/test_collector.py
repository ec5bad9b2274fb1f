"""The trainer's group collection over the in-memory rollout buffer (the RolloutBuffer link without Redis): stream
order, stale and zero-variance groups dropped and settled on the way, the accounting identity kept."""

import threading

import numpy as np

from grpo_stream.common.rollouts.buffer import Incoming
from grpo_stream.common.rollouts.registry import open_buffer
from grpo_stream.common.rollouts.wire import CompletionData, GroupData, GroupLimits, encode_group
from grpo_stream.trainer_service.learning.collector import GroupCollector


LIMITS = GroupLimits(num_generations=2, max_prompt_tokens=8, max_new_tokens=6, vocab_size=50)


def group(i: int, version: int, rewards=(0.0, 1.0), tokens: int = 2) -> Incoming:
    comps = [CompletionData(np.arange(5, 5 + tokens, dtype=np.int32), np.full(tokens, -0.1, np.float32), r, False)
             for r in rewards]
    data = GroupData(f"run/s0/{i}", f"p{i}", np.array([1, 2, 3], np.int32), comps, version, "s0", data_position=i)
    return Incoming(data.group_id, "s0", version, i, encode_group(data))


def identity_holds(c):
    return c["ingested"] == sum(c[k] for k in ("trained", "dropped_stale", "dropped_invalid", "dropped_filtered",
                                               "dropped_duplicate", "depth"))


def test_a_step_gets_usable_groups_in_stream_order_and_the_rest_is_settled_as_dropped():
    buffer = open_buffer(None, "memory")
    # versions 0..: at step 3 the trainer holds version 2; max_staleness 1 makes version 0 stale, and a version
    # ahead of the trainer's (an earlier trainer process got further) is stale too
    incoming = [group(0, 0), group(1, 2), group(2, 1, rewards=(1.0, 1.0)), group(3, 5), group(4, 1), group(5, 2),
                group(6, 2)]
    statuses, _ = buffer.append_many(incoming + [group(1, 2)], max_groups=100)
    assert statuses[-1] == "dup"
    collector = GroupCollector(buffer, groups_per_step=3, max_staleness=1, no_signal=lambda g: np.ptp(g.rewards) == 0,
                               stop_event=threading.Event(), held=lambda: 0, limits=LIMITS)
    picked = collector.collect(step=3)
    assert [g.group_id for _, g in picked] == ["run/s0/1", "run/s0/4", "run/s0/5"]
    c = buffer.counters()
    assert (c["dropped_stale"], c["dropped_filtered"], c["refused_duplicate"]) == (2, 1, 1)
    assert {k: v["outcome"] for k, v in buffer.settled.items()} == {
        "run/s0/0": "dropped_stale", "run/s0/3": "dropped_stale", "run/s0/2": "dropped_filtered"}
    assert identity_holds(c) and c["depth"] == 4  # the three picked (trained later) and one left for the next step
    buffer.settle((e.entry_id, e.group_id, "trained", 3) for e, _ in picked)
    assert identity_holds(buffer.counters()) and buffer.counters()["trained"] == 3
    collector.need = 1  # the next step takes the group not read yet
    assert [g.group_id for _, g in collector.collect(step=3)] == ["run/s0/6"]


def test_a_stop_while_waiting_returns_none_and_loses_nothing():
    buffer = open_buffer(None, "memory")
    buffer.append_many([group(0, 0)], max_groups=10)
    stop = threading.Event()
    read = buffer.read

    def read_then_stop(max_count, block_ms):  # the stop comes while it waits for a second group (not on a timer,
        entries = read(max_count, block_ms=0)  # which could fire before the first read on a loaded machine)
        if not entries:
            stop.set()
        return entries

    buffer.read = read_then_stop
    collector = GroupCollector(buffer, 2, 0, None, stop, held=lambda: 0, limits=LIMITS)
    assert collector.collect(step=1) is None
    assert [g.group_id for _, g in collector.pending] == ["run/s0/0"]
    c = buffer.counters()
    assert c["depth"] == 1 and c["trained"] == c["dropped_stale"] == 0


def test_a_restarted_trainer_reads_again_what_was_read_but_not_settled():
    buffer = open_buffer(None, "memory")
    buffer.append_many([group(i, 0) for i in range(3)], max_groups=10)
    first = buffer.read(2, 10)
    buffer.settle([(first[0].entry_id, first[0].group_id, "trained", 1)])
    buffer.redeliver()
    assert [e.group_id for e in buffer.read(10, 10)] == ["run/s0/1", "run/s0/2"]


def test_a_group_this_trainer_cannot_train_is_dropped_as_invalid_not_fatal_and_not_read_again():
    """The buffer may hold groups accepted under other limits (the trainer restarted with a smaller
    generation.max_new_tokens or num_generations) or damaged in Redis (an empty payload parses as an empty group):
    each is settled as dropped_invalid and the step takes the next groups, so no restart meets them again."""
    buffer = open_buffer(None, "memory")
    too_long = group(1, 0, tokens=LIMITS.max_new_tokens + 1)
    three = group(2, 0, rewards=(0.0, 1.0, 0.5))
    empty = Incoming("run/s0/3", "s0", 0, 3, b"")
    buffer.append_many([group(0, 0), too_long, three, empty, group(4, 0)], max_groups=100)
    collector = GroupCollector(buffer, 2, 1, None, threading.Event(), held=lambda: 0, limits=LIMITS)
    picked = collector.collect(step=1)
    assert [g.group_id for _, g in picked] == ["run/s0/0", "run/s0/4"]
    assert {k: v["outcome"] for k, v in buffer.settled.items()} == {
        "run/s0/1": "dropped_invalid", "run/s0/2": "dropped_invalid", "run/s0/3": "dropped_invalid"}
    c = buffer.counters()
    assert c["dropped_invalid"] == 3 and c["depth"] == 2 and identity_holds(c)
    buffer.redeliver()  # a restarted trainer reads only the two it has not settled
    assert [e.group_id for e in buffer.read(10, 10)] == ["run/s0/0", "run/s0/4"]
