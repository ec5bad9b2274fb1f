"""The in-memory buffer decides compaction as the Redis one does (tests/integration/test_audit_compaction.py has the
Redis side of each case)."""

from grpo_stream.common.rollouts.buffer import Incoming
from grpo_stream.common.rollouts.memory_buffer import InMemoryBuffer


def _train_step(buf, epoch: str, step: int) -> None:
    got = buf.read(100, 0)
    buf.log_step(epoch, step, [e.group_id for e in got])
    buf.settle([(e.entry_id, e.group_id, "trained", step) for e in got])
    buf.log_checkpoint(epoch, step)
    buf.compact_audit(step)


def test_compacted_steps_a_resume_rolled_back_hold_compaction_back():
    """The in-memory buffer never kept the trainer whose step it compacted through (Redis keeps it as
    through_epoch), so a resume from before the compacted steps went unnoticed: it compacted on, over steps that
    are in no step of the final model, where the Redis buffer holds back and says why."""
    buf = InMemoryBuffer()
    buf.log_trainer("a", 0, "")
    for step in (1, 2, 3):
        buf.append_many([Incoming(f"run/s0/{step}", "s0", 0, step, b"x")], 10)
        _train_step(buf, "a", step)
    assert buf.compacted["through_step"] == 3
    buf.log_trainer("b", 2, "a")
    buf.append_many([Incoming("run/s0/4", "s0", 0, 4, b"x")], 10)
    _train_step(buf, "b", 3)
    buf.log_step("b", 4, [])
    buf.log_checkpoint("b", 4)
    plan = buf.compact_audit(4)
    assert plan.through_step == 3 and "trainer b resumed from step 2" in plan.held_back, plan
    assert buf.compacted["through_step"] == 3
