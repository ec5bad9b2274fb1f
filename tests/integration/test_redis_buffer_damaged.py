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
