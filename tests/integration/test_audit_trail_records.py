"""The audit trail's trainer and checkpoint records, and what `audit` and compaction do with damaged or missing Redis
contents, against a real redis-server: checkpoint records fold to each trainer's newest, a record written twice (a
command redis-py re-sent after a lost reply) counts once, and a foreign counter, a key of another type, a damaged
trainer start or a Redis without the run are named with their fix instead of ending the audit with a bare error."""

import re

import pytest

from grpo_stream.common.rollouts.buffer import Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.reports.audit import build_audit, group_history
from tests.integration.test_audit_compaction import VERDICT, Producer, train

pytestmark = pytest.mark.redis


@pytest.fixture
def buf_pair(shared_redis, run_name):
    return RedisStreamBuffer(connect(shared_redis.url, 5), run_name), run_name


def test_checkpoint_records_fold_to_each_trainers_newest_and_the_audit_counts_them_all(shared_redis, run_name):
    """Every checkpoint left a record for the whole run, never compacted: with checkpoint.every=1 the trail grew
    by one record a step and every compaction read them all. Now all but each trainer's newest (all the lineage
    reads) fold into a count, and the audit's verdict and checkpoint count match the full trail's."""
    full = RedisStreamBuffer(connect(shared_redis.url, 5), run_name + "-full")
    kept = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    for buf in (full, kept):
        if buf is full:
            buf.compact_audit = lambda through: None  # the same run, never compacted
        producer = Producer()
        buf.log_trainer("a", 0, "")
        acked, held = train(buf, producer, "a", range(1, 42), every=2)  # crashes after step 41: it rolls back
        buf.log_trainer("b", 40, "a")
        buf.settle([r for r in held if r[3] <= 40])
        buf._recover_after = "0"
        train(buf, producer, "b", range(41, 81), every=2, acked=acked)
    before, after = build_audit(full.client, run_name + "-full"), build_audit(kept.client, run_name)
    assert before["ok"] and before["checkpoints_saved"] == 40 and before["steps_rolled_back"] == 1, before
    assert {key: after[key] for key in (*VERDICT, "checkpoints_saved", "trainer_starts")} == {
        key: before[key] for key in (*VERDICT, "checkpoints_saved", "trainer_starts")}
    assert after["compacted"]["through_step"] == 78, after["compacted"]
    assert kept.client.xlen(kept.k["audit:checkpoints"]) == 2  # a's newest and b's: all the lineage reads


def test_a_record_written_twice_counts_once_before_and_after_compaction(buf_pair):
    """redis-py re-sends a command whose reply was lost (Retry on a timeout or dropped connection), so a trainer
    start, step or checkpoint can have two records. The audit counted a second trainer start, a rolled-back step
    and an extra checkpoint, and its rolled-back count changed when compaction folded the step."""
    buf, run_name = buf_pair
    buf.append_many([Incoming(f"r/s0/{i}", "s0", 0, i, b"x") for i in range(4)], 10)
    read = buf.read(4, 50)
    for _ in range(2):
        buf.log_trainer("a", 0, "")
        buf.log_step("a", 1, [e.group_id for e in read[:2]])
        buf.log_checkpoint("a", 1)
    buf.log_step("a", 2, [e.group_id for e in read[2:]])
    buf.log_checkpoint("a", 2)
    buf.settle([(e.entry_id, e.group_id, "trained", 1) for e in read[:2]])
    expected = {"ok": True, "trainer_starts": 1, "steps_rolled_back": 0, "checkpoints_saved": 2, "groups_trained": 4}
    report = build_audit(buf.client, run_name)
    assert {key: report[key] for key in expected} == expected
    assert buf.compact_audit(1).through_step == 1
    report = build_audit(buf.client, run_name)
    assert {key: report[key] for key in expected} == expected


def small_run(buf) -> None:
    """Two trainers, each one checkpointed step of two groups; step 1's groups acknowledged."""
    buf.append_many([Incoming(f"r/s0/{i}", "s0", 0, i, b"x") for i in range(4)], 10)
    read = buf.read(4, 50)
    buf.log_trainer("a", 0, "")
    buf.log_step("a", 1, [e.group_id for e in read[:2]])
    buf.log_checkpoint("a", 1)
    buf.log_trainer("b", 1, "a")
    buf.log_step("b", 2, [e.group_id for e in read[2:]])
    buf.log_checkpoint("b", 2)
    buf.settle([(e.entry_id, e.group_id, "trained", 1) for e in read[:2]])


def test_a_counter_that_is_no_integer_is_named_not_a_crash(buf_pair):
    """A bare int() ended the audit with "invalid literal for int() with base 10: b'x'", naming no key."""
    buf, run_name = buf_pair
    small_run(buf)
    buf.client.hset(buf.k["counters"], "trained", "x")
    report = build_audit(buf.client, run_name)
    assert not report["ok"] and report["groups_trained"] == 4
    assert report["damaged_records"] == [f"{buf.k['counters']} field 'trained' holds 'x', not an integer: restore "
                                         f"it (HSET {buf.k['counters']} trained N)"]


@pytest.mark.parametrize("name", ["audit:settled", "audit:steps", "audit:compacted", "rollouts"])
def test_a_key_of_another_type_is_named_by_the_audit_and_holds_compaction_back(buf_pair, name):
    """Redis answers a read of a key of another type WRONGTYPE, naming no key: the audit ended with that bare
    ResponseError, and so did the trainer's compaction at every acknowledged checkpoint."""
    buf, run_name = buf_pair
    small_run(buf)
    key = buf.k[name]
    buf.client.delete(key)
    buf.client.set(key, "foreign")
    kind = "hash" if name in ("audit:settled", "audit:compacted") else "stream"
    described = f"{key} is a string, not the {kind}"
    report = build_audit(buf.client, run_name)
    assert not report["ok"] and any(d.startswith(described) and f"DEL {key}" in d for d in report["damaged_records"])
    if name != "rollouts":  # the buffer's own stream: the trainer's reads fail first (buffer.py)
        plan = buf.compact_audit(1)
        assert plan.through_step == 0 and described in plan.held_back, plan
    if name == "audit:settled":
        assert any(d.startswith(described) for d in group_history(buf.client, run_name, "r/s0/0")["damaged"])


def test_a_damaged_trainer_start_is_named_with_its_fix(buf_pair):
    """Trainer a's start record left out as damaged: the lineage then named trainer a without its record, and the
    audit ended with "no start record for it", naming neither the key nor the damaged record."""
    buf, run_name = buf_pair
    small_run(buf)
    trainers = buf.k["audit:trainers"]
    first = buf.client.xrange(trainers)[0][0].decode()
    buf.client.xdel(trainers, first)
    bad = buf.client.xadd(trainers, {"epoch": "a", "from_step": "zz", "from_epoch": ""}).decode()
    with pytest.raises(ValueError, match=rf"{trainers}: .*trainer a .*no start record.*XDEL {trainers} {bad}"):
        build_audit(buf.client, run_name)
    buf.client.xdel(trainers, bad)
    with pytest.raises(ValueError, match=rf"restore the trainer's start record \(XADD {trainers} "):
        build_audit(buf.client, run_name)


def test_a_redis_without_the_run_is_no_ok_verdict(shared_redis, run_name):
    """A wrong --redis-url (or database), a misspelt run, or a Redis that lost its data: the audit reported "0 groups
    accepted ... OK" and exit 0."""
    expected = f"holds nothing of run {run_name!r} (no key grpo-stream:{run_name}:"
    with pytest.raises(ValueError, match=re.escape(expected)):
        build_audit(connect(shared_redis.url, 5), run_name)


class WritesMidRead:
    """The audit's client, with a live run's write (`then`) landing right after it first reads `key`."""

    def __init__(self, client, key: str, then):
        self.client, self.key, self.then = client, key, then

    def __getattr__(self, name):
        return getattr(self.client, name)

    def _after(self, key, out):
        if key == self.key and self.then is not None:
            self.then()
            self.then = None
        return out

    def hscan_iter(self, key, **options):
        return iter(self._after(key, list(self.client.hscan_iter(key, **options))))

    def xrange(self, key, **options):
        return self._after(key, self.client.xrange(key, **options))


@pytest.mark.parametrize("write", ["settle", "compaction", "append"])
def test_a_live_runs_writes_during_the_audits_read_break_no_verdict(buf_pair, write):
    """`audit` reads a live run's trail key by key. A group settled after it read the settled records but before the
    stream was reported lost; a compaction mid-read, groups lost; a group appended after the accepted records,
    in the buffer but never accepted. Each made a healthy run BROKEN (exit 1)."""
    buf, run_name = buf_pair
    buf.log_trainer("a", 0, "")
    buf.append_many([Incoming(f"r/s0/{i}", "s0", 0, i, b"x") for i in range(3)], 10)
    got = buf.read(3, 50)
    buf.log_step("a", 1, [got[0].group_id])
    buf.log_checkpoint("a", 1)
    buf.settle([(got[0].entry_id, got[0].group_id, "trained", 1), (got[1].entry_id, got[1].group_id,
                                                                    "dropped_stale", 1)])
    key, then = {
        "settle": ("audit:settled", lambda: buf.settle([(got[2].entry_id, got[2].group_id, "dropped_stale", 1)])),
        "compaction": ("audit:accepted", lambda: buf.compact_audit(1)),
        "append": ("audit:accepted", lambda: buf.append_many([Incoming("r/s0/3", "s0", 0, 3, b"x")], 10)),
    }[write]
    client = WritesMidRead(buf.client, buf.k[key], then)
    report = build_audit(client, run_name)
    assert client.then is None  # the write landed mid-read
    assert report["ok"] and not report["groups_lost"], report
    assert report["groups_accepted"] == 3 and report["groups_trained"] == 1, report
    assert build_audit(buf.client, run_name)["ok"]
