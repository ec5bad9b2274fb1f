"""`up`'s stall watch (grpo_stream/up/supervise.py: StallWatch) across steps of the wall clock (NTP): the beats are
files' mtimes, wall time, while the watch measures on the monotonic clock; a step must neither kill a process that
beats nor hide one that hangs."""

from __future__ import annotations

from tests.support import FakeClock
from tests.unit.test_supervise_watch import beat_at, fake_run


def stepped_run(tmp_path, **policy):
    """fake_run with the wall clock (the beats' mtimes) apart from `up`'s monotonic clock, so a test can step it."""
    wall = FakeClock()
    watch, clock, trainer, _, lines = fake_run(tmp_path, wall=wall, **policy)
    return watch, clock, wall, trainer, lines


def test_a_wall_clock_step_forward_does_not_kill_a_process_that_beats(tmp_path):
    """NTP steps the clock 100 s forward (under PAUSED_S) between two looks: the beat from just before the step looked
    100 s old, and a healthy trainer was killed as stalled."""
    watch, clock, wall, trainer, lines = stepped_run(tmp_path, trainer_stall_s=60)
    for step in range(12):
        clock.advance(10)
        wall.advance(10 + (100 if step == 5 else 0))
        beat_at(tmp_path, "trainer-0", wall.now - 5)  # beat 5 s before this look
        assert watch.check() is None
        clock.advance(0.2)
        wall.advance(0.2 + (100 if step == 5 else 0))
        assert watch.check() is None
    assert trainer.killed == 0 and lines == []


def test_a_wall_clock_step_back_does_not_blind_the_watch_to_a_hang(tmp_path):
    """The clock steps back a day just after the trainer's last beat: that beat's mtime lay a day in the future, so
    the hang was seen only a day late (the watch was blind for as long as the step)."""
    watch, clock, wall, trainer, lines = stepped_run(tmp_path, trainer_stall_s=60)
    clock.advance(10)
    wall.advance(10)
    beat_at(tmp_path, "trainer-0", wall.now)
    assert watch.check() is None
    wall.advance(-86400)
    for _ in range(6):
        clock.advance(10)
        wall.advance(10)
        assert watch.check() is None and trainer.killed == 0
    clock.advance(1)
    wall.advance(1)
    assert watch.check() is None and trainer.killed == 1
    assert lines[-1].startswith("[up] trainer job made no progress for 61s (up.trainer_stall_s=60)")
