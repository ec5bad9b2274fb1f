"""Audit-trail retention against a real redis-server (and the in-memory backend): records of groups settled behind
the acknowledged checkpoint fold into counts, Redis memory per run stays bounded over a long run, `audit` reaches
the same verdict as on the full trail, a late second copy of a compacted group is still refused, and what the audit
must see (a lost group) is left in place, with every later group of its sampler. The pure decision has unit tests
(tests/unit/common/rollouts/test_audit_compaction.py)."""

import re

import pytest

from grpo_stream.reports.audit import build_audit, group_history
from grpo_stream.common.rollouts.buffer import Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from tests.integration.test_redis_buffer import any_buf  # noqa: F401 (the fixture: each backend of the registry)

pytestmark = pytest.mark.redis

VERDICT = ("groups_accepted", "groups_trained", "groups_dropped", "groups_waiting", "groups_lost",
           "groups_trained_twice", "final_step", "lineage_missing_steps", "steps_rolled_back", "ok")


class Producer:
    """Two samplers' groups in data-position order, as the ingest appends them."""

    def __init__(self):
        self.next = {"s0": 0, "s1": 0}

    def groups(self, n: int) -> list[Incoming]:
        out = []
        for i in range(n):
            sampler = f"s{i % 2}"
            pos = self.next[sampler]
            self.next[sampler] += 1
            out.append(Incoming(f"run/{sampler}/{pos}", sampler, 0, pos, b"x"))
        return out


def counts_of(raw: dict) -> dict[str, int]:
    """P:R:audit:compacted's numbers (all but the epoch of the trainer whose step through_step was)."""
    return {key.decode(): int(v) for key, v in raw.items() if key != b"through_epoch"}


def train(buf, producer: Producer, epoch: str, steps: range, per_step: int = 4, every: int = 5,
          acked: list[int] | None = None) -> tuple[list[int], list[tuple]]:
    """What the trainer does to the trail: per step read, log and hold its groups (one dropped as stale); at each
    checkpoint acknowledge the groups of the checkpoint before it and compact through that step. Returns the
    acknowledged checkpoints and the groups still held."""
    acked = [] if acked is None else acked
    held = []
    for step in steps:
        buf.append_many(producer.groups(per_step), 1000)
        got = buf.read(per_step, 100)
        buf.settle([(got[0].entry_id, got[0].group_id, "dropped_stale", step)])
        buf.log_step(epoch, step, [e.group_id for e in got[1:]])
        held += [(e.entry_id, e.group_id, "trained", step) for e in got[1:]]
        if step % every == 0:
            buf.log_checkpoint(epoch, step)
            upto = acked[-1] if acked else 0
            buf.settle([r for r in held if r[3] <= upto])
            held = [r for r in held if r[3] > upto]
            if upto:
                buf.compact_audit(upto)
            acked.append(step)
    return acked, held


def test_a_long_run_keeps_a_bounded_trail_and_refuses_late_copies(any_buf):  # noqa: F811
    producer = Producer()
    any_buf.log_trainer("a", 0, "")
    train(any_buf, producer, "a", range(1, 101))
    # 400 groups accepted; what is left of the trail is about two checkpoint windows (steps 91-100 and the
    # entries still held), not the whole run
    if isinstance(any_buf, RedisStreamBuffer):
        k = any_buf.k
        accepted = any_buf.client.hlen(k["audit:accepted"])
        settled, steps = any_buf.client.hlen(k["audit:settled"]), any_buf.client.xlen(k["audit:steps"])
        compacted = counts_of(any_buf.client.hgetall(k["audit:compacted"]))
        assert any_buf.client.hget(k["audit:compacted"], "through_epoch") == b"a"
    else:
        accepted, settled, steps = len(any_buf._accepted), len(any_buf.settled), len(any_buf.steps)
        compacted = {**any_buf.compacted, **{f"below:{s}": p for s, p in any_buf.below.items()}}
    assert accepted <= 10 * 4 and settled <= 10 * 4 and steps <= 10, (accepted, settled, steps)
    # steps 1-95 (285 trained, 95 dropped) and step 96's dropped group, the first of s0's: a drop is final
    assert compacted["through_step"] == 95 and compacted["accepted"] == 381
    assert compacted["trained"] == 285 and compacted["dropped_stale"] == 96
    assert compacted["below:s0"] == 190 and compacted["below:s1"] == 189
    # a sampler resending a group whose record was compacted (a lost acknowledgement) creates no second copy
    statuses, _ = any_buf.append_many([Incoming("run/s0/17", "s0", 0, 17, b"x")], 1000)
    assert statuses == ["dup"]
    assert any_buf.counters()["refused_duplicate"] == 1
    assert any_buf.admission_state().trainer_step == 100


def test_the_audit_reaches_the_same_verdict_on_a_compacted_trail(shared_redis, run_name):
    full = RedisStreamBuffer(connect(shared_redis.url, 5), run_name + "-full")
    kept = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    for buf, compact in ((full, False), (kept, True)):
        if not compact:
            buf.compact_audit = lambda through: None  # the same run, never compacted
        producer = Producer()
        buf.log_trainer("a", 0, "")
        acked, held = train(buf, producer, "a", range(1, 33))  # crashes after step 32: steps 31-32 roll back
        # trainer b resumes from a's checkpoint of step 30: it acknowledges the groups that checkpoint holds, and
        # takes back what a read after it (the groups of the rolled-back steps) to train them again
        buf.log_trainer("b", 30, "a")
        buf.settle([r for r in held if r[3] <= 30])
        buf._recover_after = "0"
        train(buf, producer, "b", range(31, 61), acked=acked)
    before, after = build_audit(full.client, run_name + "-full"), build_audit(kept.client, run_name)
    assert before["ok"] and before["steps_rolled_back"] == 2
    assert {key: after[key] for key in VERDICT} == {key: before[key] for key in VERDICT}
    assert after["compacted"]["through_step"] == 55 and after["compacted"]["groups"] >= 150, after["compacted"]


def test_a_lost_group_stays_visible_and_holds_its_samplers_later_groups(buf_pair):
    buf, run_name = buf_pair
    producer = Producer()
    buf.log_trainer("a", 0, "")
    buf.append_many(producer.groups(2), 1000)
    lost, other = buf.read(2, 100)  # s0's first group vanishes without a record; s1's is dropped
    buf.client.xdel(buf.stream, lost.entry_id)
    buf.settle([(other.entry_id, other.group_id, "dropped_stale", 0)])
    train(buf, producer, "a", range(1, 21))
    report = build_audit(buf.client, run_name)
    assert report["groups_lost"] == 1 and report["lost_ids"] == [lost.group_id] and not report["ok"]
    compacted = counts_of(buf.client.hgetall(buf.k["audit:compacted"]))
    # s0's watermark cannot pass the lost group, so none of s0's groups is compacted; every step lists s0's groups
    # beside s1's, and a step's groups go together (its kept record must list only groups the audit finds), so s1's
    # stay too: a loss keeps the trail whole for the audit to show
    assert "below:s0" not in compacted and compacted.get("below:s1", -1) <= 0
    assert buf.client.hexists(buf.k["audit:accepted"], "run/s0/5")
    assert buf.client.hexists(buf.k["audit:accepted"], "run/s1/5")


@pytest.fixture
def buf_pair(shared_redis, run_name):
    return RedisStreamBuffer(connect(shared_redis.url, 5), run_name), run_name


def _train_step(buf, epoch: str, step: int) -> None:
    """Read what waits, train it all at `step`, checkpoint, and compact through that step."""
    got = buf.read(100, 100)
    buf.log_step(epoch, step, [e.group_id for e in got])
    buf.settle([(e.entry_id, e.group_id, "trained", step) for e in got])
    buf.log_checkpoint(epoch, step)
    buf.compact_audit(step)


def test_a_late_group_at_a_position_compaction_passed_over_is_accepted_and_trained(any_buf):  # noqa: F811
    """Positions arrive out of order (a backlog resent after an outage, a group refused `full` and sent later):
    compaction's watermark may pass a position no group was accepted at yet. A group arriving there later is
    accepted and trained, not answered `dup` (its sampler would drop it as delivered: never trained, never
    counted); one accepted before is still refused, before and after its own compaction."""
    buf, late = any_buf, Incoming("run/s0/2", "s0", 0, 2, b"late")
    buf.log_trainer("a", 0, "")
    buf.append_many([Incoming(f"run/s0/{p}", "s0", 0, p, b"x") for p in (0, 1, 3, 5)], 1000)
    _train_step(buf, "a", 1)
    statuses, _ = buf.append_many([late, Incoming("run/s0/1", "s0", 0, 1, b"x")], 1000)
    assert statuses[0] != "dup" and statuses[1] == "dup", statuses
    assert buf.append_many([late], 1000)[0] == ["dup"]  # resent before it is trained: one copy only
    _train_step(buf, "a", 2)
    assert buf.counters()["trained"] == 5
    # the late group is compacted now: refused; position 4, passed over too and still never sent, is accepted
    statuses, _ = buf.append_many([late, Incoming("run/s0/4", "s0", 0, 4, b"x")], 1000)
    assert statuses[0] == "dup" and statuses[1] != "dup", statuses
    if isinstance(buf, RedisStreamBuffer):
        report = build_audit(buf.client, buf.run_name)
        assert report["ok"] and (report["groups_trained"], report["groups_waiting"]) == (5, 1), report


def test_a_rolled_back_step_replayed_with_the_same_groups_is_still_counted_after_compaction(shared_redis, run_name):
    """Deterministic replay: trainer a's step 3 is rolled back by a crash, and b replays it from a's checkpoint of
    step 2 with the very same groups. Compaction told the two records apart by their groups, so it folded the
    rolled-back one as a lineage step and the audit's count of rolled-back steps fell from 1 to 0."""
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    buf.append_many([Incoming(f"run/s0/{i}", "s0", 0, i, b"x") for i in range(8)], 20)
    read = buf.read(8, 50)
    g = [e.group_id for e in read]
    buf.log_trainer("a", 0, "")
    for step in (1, 2, 3):
        buf.log_step("a", step, g[2 * step - 2:2 * step])
    buf.log_checkpoint("a", 2)
    buf.log_trainer("b", 2, "a")  # a crashed after step 3
    buf.log_step("b", 3, g[4:6])
    buf.log_step("b", 4, g[6:8])
    buf.log_checkpoint("b", 3)
    buf.log_checkpoint("b", 4)
    buf.settle([(e.entry_id, e.group_id, "trained", i // 2 + 1) for i, e in enumerate(read[:6])])
    before = build_audit(buf.client, run_name)
    assert before["ok"] and before["steps_rolled_back"] == 1
    plan = buf.compact_audit(3)
    assert plan.through_step == 3 and plan.counts["steps_rolled_back"] == 1
    after = build_audit(buf.client, run_name)
    assert {key: after[key] for key in VERDICT} == {key: before[key] for key in VERDICT}


def two_checkpointed_steps(buf) -> None:
    """Two checkpointed steps of trainer epoch 'a', two groups each, step 1's acknowledged."""
    buf.append_many([Incoming(f"run/s0/{i}", "s0", 0, i, b"x") for i in range(4)], 10)
    read = buf.read(4, 50)
    buf.log_trainer("a", 0, "")
    for step in (1, 2):
        buf.log_step("a", step, [e.group_id for e in read[2 * step - 2:2 * step]])
        buf.log_checkpoint("a", step)
    buf.settle([(e.entry_id, e.group_id, "trained", 1) for e in read[:2]])


def damaged_run(buf, damage: str) -> None:
    """two_checkpointed_steps, then one record no trainer wrote."""
    two_checkpointed_steps(buf)
    c, k = buf.client, buf.k
    if damage == "accepted":
        c.hset(k["audit:accepted"], "foreign", "not json")
    elif damage == "steps":
        c.xadd(k["audit:steps"], {"epoch": "a", "step": 1})
    else:
        c.hset(k["audit:compacted"], "below:s9", "x")


DAMAGES = {"accepted": r"audit:accepted field 'foreign' .*HDEL \S+:audit:accepted foreign",
           "steps": r"audit:steps record \S+ has no valid groups .*XDEL \S+:audit:steps",
           "compacted": r"audit:compacted field 'below:s9' .*HDEL \S+:audit:compacted below:s9"}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_record_holds_compaction_back_and_the_audit_names_it(shared_redis, run_name, damage):
    """One record grpo-stream did not write (a foreign tool, a hand edit): compaction, which the trainer runs at
    every acknowledged checkpoint, raised a bare JSONDecodeError/KeyError/ValueError naming no key, at every
    checkpoint and after every restart; the audit died the same way. Now both name the record and its fix."""
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    damaged_run(buf, damage)
    plan = buf.compact_audit(1)
    assert plan.through_step == 0 and not plan.group_ids
    assert re.search(DAMAGES[damage], plan.held_back), plan.held_back
    report = build_audit(buf.client, run_name)
    assert not report["ok"] and report["groups_trained"] == 4 and not report["groups_lost"]
    assert len(report["damaged_records"]) == 1 and re.search(DAMAGES[damage], report["damaged_records"][0])
    fix = re.search(r"(HDEL|XDEL) (\S+) ([^\s)]+)", report["damaged_records"][0]).groups()
    buf.client.execute_command(*fix)  # the command the message gives
    assert buf.compact_audit(1).through_step == 1 and build_audit(buf.client, run_name)["ok"]


def test_one_groups_history_reads_past_damaged_records_and_names_them(shared_redis, run_name):
    """`audit --group` read the trail with bare json.loads: one foreign step record (no groups) or a group's
    record that is not JSON ended it with a traceback. Now the history gives what it can read and names the rest."""
    buf = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    damaged_run(buf, "steps")
    buf.client.hset(buf.k["audit:settled"], "run/s0/0", "not json")
    history = group_history(buf.client, run_name, "run/s0/0")
    assert history["trained_in_steps"] == [{"epoch": "a", "step": 1}] and history["settled"] is None
    assert history["accepted"]["sampler"] == "s0"
    assert len(history["damaged"]) == 2 and any(re.search(DAMAGES["steps"], d) for d in history["damaged"])
    assert any("audit:settled field 'run/s0/0' holds 'not json'" in d for d in history["damaged"])


def test_a_group_trained_again_after_its_compaction_keeps_its_step_for_the_audit(buf_pair):
    """Compaction folded a step's record once every group it lists had no accepted record, and took a group it had
    folded before for one of them: a later step that trained a compacted group again went without a trace and the
    audit said OK. The record stays now, and the audit names the group."""
    buf, run_name = buf_pair
    buf.log_trainer("a", 0, "")
    buf.append_many([Incoming(f"run/s0/{p}", "s0", 0, p, b"x") for p in (0, 1)], 10)
    _train_step(buf, "a", 1)  # both trained and compacted
    buf.log_step("a", 2, ["run/s0/0"])  # trained a second time
    buf.append_many([Incoming("run/s0/2", "s0", 0, 2, b"x")], 10)
    _train_step(buf, "a", 3)
    plan = buf.compact_audit(3)
    assert plan.through_step == 1 and "run/s0/0" in plan.held_back, plan
    report = build_audit(buf.client, run_name)
    assert not report["ok"] and report["trained_but_not_accepted"] == ["run/s0/0"], report


def test_a_group_trained_again_before_its_compaction_stays_trained_twice(buf_pair):
    """A group listed by a step up to the compacted one and by a later lineage step is trained twice already: it
    stays, so the audit reports it as that (it was folded as trained once, then named as never accepted)."""
    buf, run_name = buf_pair
    buf.log_trainer("a", 0, "")
    buf.append_many([Incoming(f"run/s0/{p}", "s0", 0, p, b"x") for p in (0, 1)], 10)
    got = buf.read(2, 50)
    buf.log_step("a", 1, [e.group_id for e in got])
    buf.log_step("a", 2, ["run/s0/0"])
    buf.log_checkpoint("a", 2)
    buf.settle([(e.entry_id, e.group_id, "trained", 1) for e in got])
    buf.compact_audit(1)
    report = build_audit(buf.client, run_name)
    assert not report["ok"] and report["trained_twice_ids"] == ["run/s0/0"], report


def test_compacted_steps_a_resume_rolled_back_are_reported_not_counted_as_trained(buf_pair):
    """The two newest checkpoints unusable (docs/operations.md, "Limits"): trainer b resumes from step 2, before
    the compacted step 3, so the group of a's step 3 (acknowledged, folded as trained) is in no step of the
    final model. The full trail's audit calls them lost; the compacted one said OK. Now it is BROKEN, and
    compaction holds back."""
    buf, run_name = buf_pair
    buf.log_trainer("a", 0, "")
    for step in (1, 2, 3):
        buf.append_many([Incoming(f"run/s0/{step}", "s0", 0, step, b"x")], 10)
        _train_step(buf, "a", step)
    assert build_audit(buf.client, run_name)["ok"]
    buf.log_trainer("b", 2, "a")
    buf.append_many([Incoming("run/s0/4", "s0", 0, 4, b"x")], 10)
    _train_step(buf, "b", 3)
    report = build_audit(buf.client, run_name)
    assert not report["ok"] and re.search(r"steps up to 3 .*trainer b resumed from step 2", report["compacted"][
        "rolled_back"]), report["compacted"]
    buf.log_step("b", 4, [])
    buf.log_checkpoint("b", 4)
    plan = buf.compact_audit(4)
    assert plan.through_step == 3 and plan.held_back == report["compacted"]["rolled_back"], plan


def test_a_group_in_the_buffer_without_an_accepted_record_is_reported(buf_pair):
    """Compaction that folded a group still in flight (its accepted record gone, its entry still in the stream):
    the audit counted it nowhere and said OK."""
    buf, run_name = buf_pair
    buf.append_many([Incoming(f"run/s0/{p}", "s0", 0, p, b"x") for p in (0, 1)], 10)
    buf.client.hdel(buf.k["audit:accepted"], "run/s0/1")
    report = build_audit(buf.client, run_name)
    assert not report["ok"] and report["waiting_but_not_accepted"] == ["run/s0/1"], report
    assert report["groups_waiting"] == 1
