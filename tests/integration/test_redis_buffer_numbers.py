"""Numbers in the buffer's keys that look like numbers but are not ones Redis counts on (a hand edit, another tool):
the scripts and compaction checked them with looser rules than HINCRBY's own, so '007', '1_000', ' 5', a value past
int64, or a watermark of '1e400' passed the check and then failed the write half-way, or silently refused every
later group of a sampler as a duplicate. Each is now named with its key and field, and nothing is written."""

import re

import grpc
import pytest
import redis

from grpo_stream.common.rollouts.buffer import Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.wire import GroupLimits
from grpo_stream.protos import rollout_pb2
from grpo_stream.reports.audit import build_audit
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from tests.integration.test_audit_compaction import two_checkpointed_steps
from tests.integration.test_auth import dataset_group
from tests.support import Aborted, AbortingContext

pytestmark = pytest.mark.redis

# integers by Python's int() or Lua's tonumber(), but not by Redis's HINCRBY (or past what it can add to)
NOT_COUNTABLE = ["007", "-0", "1_000", " 5", "+5", "99999999999999999999", "9223372036854775807"]


@pytest.fixture
def buf(shared_redis, run_name):
    return RedisStreamBuffer(connect(shared_redis.url, 5), run_name)


def group(i: int, sampler: str = "s0") -> Incoming:
    return Incoming(f"run/{sampler}/{i}", sampler, 0, i, f"g{i}".encode())


@pytest.mark.parametrize("value", NOT_COUNTABLE)
@pytest.mark.parametrize("key, field", [("counters", "ingested"), ("by_sampler", "s0")])
def test_a_count_hincrby_refuses_refuses_the_append_writing_nothing(buf, key, field, value):
    """It passed the script's check ('^-?%d+$'), then its HINCRBY failed after the XADD: a group in the stream and
    the accepted set that no counter knew, a bare 'hash value is not an integer', and the resent copy answered dup."""
    buf.client.hset(buf.k[key], field, value)
    with pytest.raises(redis.ResponseError, match=rf"DAMAGEDBUFFER {re.escape(buf.k[key])} field {field} holds "
                                                   r".*not an integer; nothing was written"):
        buf.append_many([group(1)], max_groups=10)
    assert buf.depth() == 0 and buf.client.hlen(buf.k["audit:accepted"]) == 0


@pytest.mark.parametrize("value", ["007", "99999999999999999999"])
def test_a_count_hincrby_refuses_refuses_the_settle_losing_no_group(buf, value):
    buf.append_many([group(i) for i in range(2)], max_groups=10)
    read = buf.read(2, block_ms=10)
    buf.client.hset(buf.k["counters"], "trained", value)
    records = [(e.entry_id, e.group_id, "trained", 1) for e in read]
    with pytest.raises(redis.ResponseError, match=r"DAMAGEDBUFFER .*counters field trained holds .*nothing was"):
        buf.settle(records)
    assert buf.depth() == 2
    buf.client.hset(buf.k["counters"], "trained", 0)
    assert buf.settle(records) == 2


@pytest.mark.parametrize("value", ["1e400", "0x10", "2.5", "inf", " 3"])
def test_a_compaction_watermark_that_is_no_integer_refuses_the_append(buf, value):
    """Lua's tonumber() took '1e400' (infinity: every later group of the sampler answered dup, never appended nor
    counted, while its sampler moved on) and '0x10' (16, where the audit and compaction saw a damaged record)."""
    buf.client.hset(buf.k["audit:compacted"], "below:s0", value)
    with pytest.raises(redis.ResponseError, match=rf"DAMAGEDBUFFER {re.escape(buf.k['audit:compacted'])} field "
                                                   r"below:s0 holds .*nothing was written"):
        buf.append_many([group(5), group(1, "s1")], max_groups=10)
    assert buf.depth() == 0 and buf.counters()["refused_duplicate"] == 0


def test_a_damaged_watermark_reaches_the_sampler_as_failed_precondition(buf):
    """The watermark's refusal was coded DAMAGEDAUDIT, which the ingest does not know as damage: it escaped as
    UNKNOWN, which a sampler retries as a passing failure, for ever, with no reason given."""
    buf.client.hset(buf.k["audit:compacted"], "below:s0", "x")
    ingest = push_refused(buf, f"HSET {buf.k['audit:compacted']} below:s0 N")
    assert buf.depth() == 0
    # a restarted sampler's resume point, whose unanswered positions are judged by the same watermark
    buf.client.hset(buf.k["positions"], "s0", 9)
    context = AbortingContext()
    with pytest.raises(Aborted):
        ingest.GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id="s0"), context)
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION and "below:s0" in context.details


@pytest.mark.parametrize("value", ["1_000", " 5", "007", "9223372036854775807"])
def test_a_compacted_count_hincrby_refuses_holds_compaction_back(buf, value):
    """read as a number by int(), the count was planned on; then its HINCRBY failed inside the transaction, whose
    other commands Redis still ran: the accepted records of the folded groups were deleted, their count never added,
    and the audit said OK with the groups gone from it."""
    two_checkpointed_steps(buf)
    buf.client.hset(buf.k["audit:compacted"], "accepted", value)
    plan = buf.compact_audit(1)
    assert plan.through_step == 0 and not plan.group_ids
    assert f"audit:compacted field 'accepted' holds {value!r}" in plan.held_back
    assert buf.client.hlen(buf.k["audit:accepted"]) == 4
    report = build_audit(buf.client, buf.run_name)
    assert not report["ok"] and any("field 'accepted'" in d for d in report["damaged_records"])
    buf.client.hset(buf.k["audit:compacted"], "accepted", 0)
    assert buf.compact_audit(1).through_step == 1 and build_audit(buf.client, buf.run_name)["ok"]


def test_a_damaged_count_of_a_run_named_like_a_redis_code_is_named_not_retried(shared_redis, run_name):
    """The refusal names its key, 'grpo-stream:LOADING-...:counters', and that read as Redis still loading: the
    ingest answered UNAVAILABLE and the sampler retried for ever."""
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), f"LOADING-{run_name}")
    buf.client.hset(buf.k["counters"], "ingested", "x")
    push_refused(buf, f"HSET {buf.k['counters']} ingested N")


def push_refused(buf: RedisStreamBuffer, fix: str) -> IngestServicer:
    """The ingest (returned) refuses a sampler's group as damage in the buffer (FAILED_PRECONDITION, not retried),
    saying `fix`."""
    ingest = IngestServicer(buf, GroupLimits(4, 8, 8, 50), max_groups=10, retry_after_ms=100)
    context = AbortingContext()
    with pytest.raises(Aborted):
        ingest.PushGroup(dataset_group(buf.run_name, "s0", 5), context)
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION and fix in context.details, context.details
    return ingest
