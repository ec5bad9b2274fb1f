"""The rollout buffer over Redis contents grpo-stream did not write (a hand edit, another tool, a partial restore):
each is named with its key, field and fix, and nothing of a batch is written. Redis does not roll a script back, so
a counter that was no integer used to fail the append script's HINCRBY after its XADD: a group in the stream that no
counter knew, and a bare Lua error ("attempt to compare nil with number") at the sampler for every later batch."""

import re

import grpc
import pytest
import redis

from grpo_stream.common.rollouts.buffer import Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_errors import DamagedRecord
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.wire import GroupLimits
from grpo_stream.protos import rollout_pb2
from grpo_stream.trainer_service.ingest.admission import AdmissionControl, AdmissionLimits
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from tests.support import Aborted, AbortingContext

pytestmark = pytest.mark.redis


@pytest.fixture
def buf(shared_redis, run_name):
    return RedisStreamBuffer(connect(shared_redis.url, 5), run_name)


def group(i: int, sampler: str = "s0") -> Incoming:
    return Incoming(f"run/{sampler}/{i}", sampler, 0, i, f"g{i}".encode())


# (key name in buffer.k, field or None for a plain string key, what the message names)
DAMAGES = [("positions", "s0", "positions field s0"), ("by_sampler", "s0", "by_sampler field s0"),
           ("counters", "ingested", "counters field ingested"),
           ("counters", "refused_full", "counters field refused_full"), ("held", None, "held")]


@pytest.mark.parametrize("key, field, named", DAMAGES, ids=[d[2] for d in DAMAGES])
def test_a_number_the_append_script_updates_that_is_no_integer_refuses_the_batch_writing_nothing(buf, key, field,
                                                                                                  named):
    if field is None:
        buf.client.set(buf.k[key], "x")
    else:
        buf.client.hset(buf.k[key], field, "x")
    with pytest.raises(redis.ResponseError, match=rf"DAMAGEDBUFFER {re.escape(buf.base)}:{named} .*not an integer; "
                                                   r"nothing was written. Restore it \(H?SET "):
        buf.append_many([group(1, "s1"), group(1)], max_groups=10)
    assert buf.depth() == 0
    assert buf.client.hlen(buf.k["audit:accepted"]) == 0 and buf.client.hget(buf.k["by_sampler"], "s1") is None


def test_a_buffer_key_of_another_type_refuses_the_batch_naming_it(buf):
    buf.client.set(buf.k["counters"], "not a hash")
    damaged = rf"DAMAGEDBUFFER {re.escape(buf.k['counters'])} is a string, not the hash"
    with pytest.raises(redis.ResponseError, match=damaged):
        buf.append_many([group(1)], max_groups=10)
    assert buf.depth() == 0 and buf.client.hlen(buf.k["audit:accepted"]) == 0


def test_a_damaged_resume_position_is_named_to_the_sampler_not_a_bare_error(buf):
    """GetDataPosition used to fail with "Exception calling application: invalid literal for int()", which a
    sampler retries as a passing failure; FAILED_PRECONDITION with the field and the fix stops it with the reason."""
    buf.client.hset(buf.k["positions"], "s0", "1e+17")
    named = rf"{re.escape(buf.k['positions'])} field s0 holds '1e\+17', not an integer"
    with pytest.raises(DamagedRecord, match=named):
        buf.data_position("s0")
    ingest = IngestServicer(buf, GroupLimits(2, 8, 8, 50), max_groups=10, retry_after_ms=100)
    context = AbortingContext()
    with pytest.raises(Aborted):
        ingest.GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id="s0"), context)
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"HSET {buf.k['positions']} s0 N" in context.details


def test_a_damaged_counter_is_named_by_the_readers_of_the_counters(buf):
    buf.client.hset(buf.k["counters"], "trained", "x")
    with pytest.raises(DamagedRecord, match=rf"{re.escape(buf.k['counters'])} field trained holds 'x'"):
        buf.counters()
    ingest = IngestServicer(buf, GroupLimits(2, 8, 8, 50), max_groups=10, retry_after_ms=100,
                            admission=AdmissionControl(AdmissionLimits(4, 1, 10, 30.0, 8)))
    context = AbortingContext()
    with pytest.raises(Aborted):
        ingest.Admit(rollout_pb2.AdmitRequest(sampler_id="s0", groups=2), context)
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION and "counters field trained" in context.details


SETTLE_DAMAGES = {"counter": ("counters", "hset", ("trained", "x"),
                              r"counters field trained holds \"x\", not an integer"),
                  "settled": ("audit:settled", "set", ("x",), r"audit:settled is a string, not the hash"),
                  "duplicates": ("audit:duplicates", "set", ("x",), r"audit:duplicates is a string, not the hash")}


@pytest.mark.parametrize("damage", SETTLE_DAMAGES)
def test_a_settle_over_damaged_contents_is_refused_naming_the_key_and_loses_no_group(buf, damage):
    """The settle script deleted the entries from the stream and then failed on the counter (or the settled
    record): the groups were gone from the stream and counted nowhere, for good (a retry found nothing to count)."""
    buf.append_many([group(i) for i in range(3)], max_groups=10)
    read = buf.read(4, block_ms=10)
    key, command, args, named = SETTLE_DAMAGES[damage]
    getattr(buf.client, command)(buf.k[key], *args)
    records = [(e.entry_id, e.group_id, "trained", 1) for e in read[:2]]
    records.append((read[2].entry_id, read[2].group_id, "dropped_duplicate", -1))
    with pytest.raises(redis.ResponseError, match=rf"DAMAGEDBUFFER {re.escape(buf.base)}:{named}.*nothing was written"):
        buf.settle(records)
    assert buf.depth() == 3  # every group still in the stream, to be settled once the key is restored
    buf.client.delete(buf.k[key])
    assert buf.settle(records) == 3


PROMPT_DAMAGES = {"prompt hash": ("prompt:p1", r"prompt:p1 is a string, not the hash"),
                  "pending count": ("inject:pending", r"inject:pending field c1 holds \"x\", not an integer"),
                  "evaluation record": ("audit:eval", r"audit:eval is a string, not the hash")}


@pytest.mark.parametrize("damage", PROMPT_DAMAGES)
def test_an_injected_answers_damaged_prompt_keys_refuse_the_whole_batch_writing_nothing(buf, damage):
    """An answer later in a batch met its damaged prompt key after the groups before it were appended: groups in the
    stream and the accepted set that no counter knew (the accounting identity broken) and a bare WRONGTYPE."""
    key, named = PROMPT_DAMAGES[damage]
    prompt = {"state": "claimed", "train": "0" if damage == "evaluation record" else "1", "client": "c1"}
    if damage == "prompt hash":
        buf.client.set(f"{buf.base}:{key}", "x")
    else:
        buf.client.hset(f"{buf.base}:prompt:p1", mapping=prompt)
        if damage == "evaluation record":
            buf.client.set(f"{buf.base}:{key}", "x")
        else:
            buf.client.hset(f"{buf.base}:{key}", "c1", "x")
    answer = Incoming("run/inj/p1", "s0", 0, -1, b"answer", injected_prompt="p1")
    with pytest.raises(redis.ResponseError, match=rf"DAMAGEDBUFFER {re.escape(buf.base)}:{named}.*nothing was written"):
        buf.append_many([group(0), answer], max_groups=10)
    assert buf.depth() == 0 and buf.client.hlen(buf.k["audit:accepted"]) == 0 and buf.counters()["ingested"] == 0


def test_the_trainers_read_names_a_stream_key_of_another_type_and_a_lost_consumer_group(buf):
    """The trainer's read failed with a bare WRONGTYPE naming no key; a consumer group deleted under a running
    trainer (or lost with Redis's data) failed every read with NOGROUP, saying nothing of what to do."""
    buf.client.set(buf.stream, "not a stream")
    with pytest.raises(DamagedRecord, match=rf"{re.escape(buf.stream)} is a string, not the stream .*restore the key"):
        buf.read(4, block_ms=10)
    buf.client.delete(buf.stream)
    buf.append_many([group(0)], max_groups=10)
    assert len(buf.read(4, block_ms=10)) == 1
    buf.client.xgroup_destroy(buf.stream, "trainer")
    with pytest.raises(DamagedRecord, match=rf"{re.escape(buf.stream)}: its consumer group 'trainer' is gone .*start "
                                            "the trainer again"):
        buf.read(4, block_ms=10)


def test_a_damaged_per_sampler_count_is_named_to_the_trainer_not_a_bare_value_error(buf):
    buf.client.hset(buf.k["by_sampler"], "s0", "x")
    with pytest.raises(DamagedRecord, match=rf"{re.escape(buf.k['by_sampler'])} field s0 holds 'x'.*HSET "):
        buf.ingested_by_sampler()
