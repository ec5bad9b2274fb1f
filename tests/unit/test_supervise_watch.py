"""`up`'s supervision loop (grpo_stream/up/supervise.py: Watch, StallWatch): a permanent failure stops the run naming
the process and its reason and is never restarted; a trainer job that makes no progress for up.trainer_stall_s is
killed and restarted against the restart budget. Decisions on fake clocks and fake processes, then real child
processes standing in for the trainer and a sampler."""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

from grpo_stream.common.config.process import UpSection
from grpo_stream.common.runtime.errors import PermanentError, failure_path, read_permanent, record_permanent
from grpo_stream.common.runtime.heartbeat import beat, beat_path
from grpo_stream.up.supervise import StallWatch, Watch
from grpo_stream.up.run import _Child, _StopSignals, _TrainerJob
from grpo_stream.up.processes import ProcessSpec
from tests.support import FakeClock


def beat_at(run_dir, name: str, when: float) -> None:
    beat(run_dir, name)
    os.utime(beat_path(run_dir, name), (when, when))


def test_the_stall_clock_runs_from_the_start_until_the_first_beat_then_from_the_newest_beat(tmp_path):
    clock = FakeClock()
    watch = StallWatch(tmp_path, ["trainer-0", "trainer-1"], stall_s=100, clock=clock, wall=clock)
    clock.advance(100)
    assert watch.stalled() is None  # compiling: 100 s since the start is not more than 100
    clock.advance(1)
    assert watch.stalled() == 101  # never beat: measured from the job's start
    clock.advance(30)
    beat_at(tmp_path, "trainer-1", clock.now - 10)  # one process of the job made progress 10 s ago
    beat_at(tmp_path, "trainer-0", clock.now - 500)  # a beat's age is never taken past the previous look (30 s)
    assert watch.idle_s() == 10 and watch.stalled() is None
    clock.advance(95)
    assert watch.stalled() == 105


def test_a_beat_from_before_a_restart_does_not_count_against_the_new_job(tmp_path):
    clock = FakeClock()
    beat_at(tmp_path, "trainer-0", clock.now - 5000)  # the last beat of a job that hung, or of an earlier `up`
    watch = StallWatch(tmp_path, ["trainer-0"], stall_s=60, clock=clock)
    assert watch.stalled() is None and watch.idle_s() == 0
    clock.advance(61)
    assert watch.stalled() == 61
    watch.restarted()
    assert watch.stalled() is None


def test_zero_turns_the_watchdog_off(tmp_path):
    clock = FakeClock()
    watch = StallWatch(tmp_path, ["trainer-0"], stall_s=0, clock=clock)
    clock.advance(10 ** 6)
    assert watch.stalled() is None


def test_the_setting_is_validated():
    assert UpSection().trainer_stall_s == 1800
    for bad in (-1, "soon"):
        try:
            UpSection(trainer_stall_s=bad)
        except ValueError:
            continue
        raise AssertionError(f"trainer_stall_s={bad!r} accepted")


class FakeUnit:
    """A supervised unit whose exit code the test sets."""

    must_run = False

    def __init__(self, name: str, record: str):
        self.name, self.records, self.code, self.starts, self.killed = name, (record,), None, 0, 0

    def start(self):
        self.starts, self.code = self.starts + 1, None

    def poll(self):
        return self.code

    def alive(self):
        return self.code is None

    def terminate(self):
        pass

    def kill(self):
        self.killed, self.code = self.killed + 1, -9


def fake_run(tmp_path, wall=None, **policy):
    """`wall`: the beats' clock (their mtimes), else `up`'s own."""
    clock, lines = FakeClock(), []
    trainer, sampler = FakeUnit("trainer", "trainer-0"), FakeUnit("sampler-0", "sampler-0")
    watch = Watch(UpSection(restart_backoff_s=1, **policy), tmp_path, trainer, [sampler], log=lines.append,
                  clock=clock, wall=wall or clock, samplers=[sampler])
    for unit in (trainer, sampler):
        watch.launch(unit)
    return watch, clock, trainer, sampler, lines


def test_a_permanent_failure_stops_the_run_with_its_reason_and_is_not_restarted(tmp_path):
    record_permanent(tmp_path, "sampler-0", PermanentError("an old attempt's reason"))
    watch, clock, trainer, sampler, lines = fake_run(tmp_path)
    assert read_permanent(tmp_path, "sampler-0") is None  # cleared before the start: it spoke for an old attempt
    record_permanent(tmp_path, "sampler-0", PermanentError("model.path holds 2 layers,\nthe trainer's 4"))
    sampler.code = 3
    outcome = watch.check()
    assert (outcome.reason, outcome.process, outcome.message) == (
        "permanent", "sampler-0", "model.path holds 2 layers, the trainer's 4")
    assert lines == ["[up] sampler-0 failed permanently (exit code 3), so it is not restarted; stopping the run: "
                     "model.path holds 2 layers, the trainer's 4"]
    assert sampler.starts == 1 and not watch.supervisor.waiting("sampler-0")


def test_a_config_error_of_a_child_is_not_restarted_either(tmp_path):
    """Exit 2: the child's config or arguments were refused; its next start would read the same ones."""
    watch, _, _, sampler, lines = fake_run(tmp_path)
    record_permanent(tmp_path, "sampler-0", ValueError("sampler.prompts_per_batch: must be at least 1"))
    sampler.code = 2
    outcome = watch.check()
    assert outcome.reason == "permanent" and "prompts_per_batch" in outcome.message
    assert sampler.starts == 1 and "not restarted" in lines[0]


def test_a_job_whose_member_recorded_a_permanent_failure_is_not_restarted_whatever_code_came_first(tmp_path):
    """A 2-process trainer: the process that recorded the permanent failure may still be shutting down when its
    peer, now without it, exits 1 (or is killed); the record decides."""
    watch, _, trainer, _, lines = fake_run(tmp_path)
    record_permanent(tmp_path, "trainer-0", PermanentError("checkpoint.dir holds a different model"))
    trainer.code = 1
    outcome = watch.check()
    assert outcome.reason == "permanent" and outcome.message == "checkpoint.dir holds a different model"
    assert trainer.starts == 1 and "not restarted" in lines[0]


def test_a_permanent_failure_without_a_record_points_at_the_log(tmp_path):
    watch, _, trainer, _, _ = fake_run(tmp_path)
    trainer.code = 3
    outcome = watch.check()
    assert outcome.reason == "permanent" and outcome.message == f"see {tmp_path / 'logs' / 'trainer.log'}"


def test_a_stalled_trainer_is_killed_and_restarted_within_the_budget(tmp_path):
    watch, clock, trainer, sampler, lines = fake_run(tmp_path, trainer_stall_s=60, restart_limit_burst=1)
    beat_at(tmp_path, "trainer-0", clock.now)
    clock.advance(59)
    assert watch.check() is None and trainer.killed == 0
    clock.advance(2)  # 61 s since its last beat
    assert watch.check() is None and trainer.killed == 1
    assert lines[-1].startswith("[up] trainer job made no progress for 61s (up.trainer_stall_s=60); restarting it in")
    clock.advance(1.0)
    assert watch.check() is None and trainer.starts == 2 and watch.supervisor.restarts["trainer"] == 1
    clock.advance(30)
    assert watch.check() is None  # the restarted job gets its own 60 s (the old beat is from before it)
    clock.advance(31)
    # stalled again without any progress since its restart: its 61 s of uptime were not healthy (it hangs at the
    # same point), so past the burst of 1 the run stops like a crash loop
    outcome = watch.check()
    assert outcome.reason == "gave_up" and outcome.process == "trainer" and trainer.killed == 2
    assert "stopping the run (1 of up.restart_limit_burst=1" in lines[-1]
    assert sampler.starts == 1  # the samplers were left alone


def test_a_job_that_made_progress_for_a_while_before_it_stalled_was_healthy(tmp_path):
    watch, clock, trainer, _, lines = fake_run(tmp_path, trainer_stall_s=60, restart_limit_burst=1,
                                               healthy_after_s=100)
    for _ in range(3):  # each time: 150 s of steps (past up.healthy_after_s), then a hang
        for _ in range(3):
            clock.advance(50)
            beat_at(tmp_path, "trainer-0", clock.now)
            assert watch.check() is None
        clock.advance(61)
        assert watch.check() is None and "restarting it in" in lines[-1]
        clock.advance(1.0)
        assert watch.check() is None
    assert trainer.starts == 4 and watch.supervisor.restarts["trainer"] == 3


def test_a_trainer_that_beats_is_never_stalled_and_a_finished_one_ends_the_watch(tmp_path):
    watch, clock, trainer, _, _ = fake_run(tmp_path, trainer_stall_s=60)
    for _ in range(20):
        clock.advance(50)
        beat_at(tmp_path, "trainer-0", clock.now)
        assert watch.check() is None
    trainer.code = 0
    assert watch.check().reason == "done" and trainer.killed == 0


def test_a_stalled_sampler_is_killed_and_restarted_and_the_trainer_left_alone(tmp_path):
    watch, clock, trainer, sampler, lines = fake_run(tmp_path, sampler_stall_s=60, trainer_stall_s=0)
    beat_at(tmp_path, "sampler-0", clock.now)
    clock.advance(59)
    assert watch.check() is None and sampler.killed == 0
    clock.advance(2)
    assert watch.check() is None and sampler.killed == 1 and trainer.killed == 0
    assert lines[-1].startswith("[up] sampler-0 process made no progress for 61s (up.sampler_stall_s=60); "
                                "restarting it in")
    clock.advance(1.0)
    assert watch.check() is None and sampler.starts == 2 and watch.supervisor.restarts["sampler-0"] == 1


def test_a_pause_of_the_whole_run_is_not_a_stall_and_a_real_hang_after_it_still_is(tmp_path):
    """The host suspended (or a scheduler SIGSTOPped the whole job) for 2 h: nobody beat, `up` did not look either.
    On resume every process was killed as stalled, and the work since each one's last checkpoint lost."""
    watch, clock, trainer, sampler, lines = fake_run(tmp_path, trainer_stall_s=1800, sampler_stall_s=1800)
    for _ in range(10):
        clock.advance(10)
        beat_at(tmp_path, "trainer-0", clock.now)
        beat_at(tmp_path, "sampler-0", clock.now)
        assert watch.check() is None
    clock.advance(7200)
    assert watch.check() is None and trainer.killed == sampler.killed == 0
    assert lines == ["[up] up itself did not run for 7200s (the host suspended, or the run was stopped); the stall "
                     "watch counts progress from now"]
    for _ in range(19):  # the trainer beats again, the sampler stays hung after the resume: its stall is still seen
        clock.advance(100)
        beat_at(tmp_path, "trainer-0", clock.now)
        assert watch.check() is None
    assert trainer.killed == 0 and sampler.killed == 1
    assert lines[-1].startswith("[up] sampler-0 process made no progress for 1900s (up.sampler_stall_s=1800)")


def child(tmp_path, name: str, record: str, code: str) -> _Child:
    (tmp_path / "logs").mkdir(exist_ok=True)
    return _Child(ProcessSpec(name, (sys.executable, "-c", code, str(tmp_path)), dict(os.environ), "x", record),
                  tmp_path / "logs")


SLEEPER = "import time; time.sleep(60)"
BEATER = ("import sys, time; from grpo_stream.common.runtime.heartbeat import beat\n"
          "for _ in range(12):\n    beat(sys.argv[1], 'trainer-0'); time.sleep(0.25)")
REFUSER = ("import sys; from grpo_stream.common.runtime.errors import PermanentError, record_permanent\n"
           "record_permanent(sys.argv[1], 'sampler-0', PermanentError('sampler.model differs from the trainer'))\n"
           "sys.exit(3)")


def watch_real(tmp_path, trainer, others, samplers=(), **policy):
    lines = []
    watch = Watch(UpSection(restart_backoff_s=0.1, restart_backoff_max_s=0.2, **policy), tmp_path, trainer, others,
                  log=lines.append, samplers=samplers)
    try:
        for unit in (trainer, *others):
            watch.launch(unit)
        return watch.run(lambda: False, poll_s=0.05), lines
    finally:
        for unit in (trainer, *others):
            unit.kill()


def test_real_processes_a_hung_trainer_is_restarted_until_the_budget_stops_the_run(tmp_path):
    trainer = child(tmp_path, "trainer", "trainer-0", SLEEPER)  # alive, never beats: hung
    outcome, lines = watch_real(tmp_path, trainer, [], trainer_stall_s=1.0, restart_limit_burst=1)
    assert outcome.reason == "gave_up" and trainer.starts == 2, lines
    assert sum("trainer job made no progress for" in line for line in lines) == 2, lines
    assert trainer.proc.returncode == -9  # killed, not asked


def test_real_processes_a_beating_trainer_runs_to_its_end(tmp_path):
    trainer = child(tmp_path, "trainer", "trainer-0", BEATER)  # 3 s of work, a beat every 0.25 s
    outcome, lines = watch_real(tmp_path, trainer, [], trainer_stall_s=1.0)
    assert outcome.reason == "done" and trainer.starts == 1 and not lines


FROZEN_SAMPLER = ("import re, sys, time; from grpo_stream.common.runtime.heartbeat import beat\n"
                  "for _ in range(4):\n    beat(sys.argv[1], 'sampler-0'); time.sleep(0.1)\n"
                  "re.match('(a|aa)*$', 'a' * 64 + '!')  # holds the GIL for hours: no thread of it can beat")


def test_real_processes_a_sampler_frozen_by_a_regular_expression_is_restarted(tmp_path):
    trainer = child(tmp_path, "trainer", "trainer-0", SLEEPER)
    sampler = child(tmp_path, "sampler-0", "sampler-0", FROZEN_SAMPLER)
    outcome, lines = watch_real(tmp_path, trainer, [sampler], trainer_stall_s=0, sampler_stall_s=1.0,
                                restart_limit_burst=1, samplers=[sampler])
    assert (outcome.reason, outcome.process) == ("gave_up", "sampler-0") and sampler.starts == 2, lines
    assert sum("sampler-0 process made no progress for" in line for line in lines) == 2, lines
    assert sampler.proc.returncode == -9 and trainer.starts == 1


def test_real_processes_a_permanent_sampler_failure_stops_the_run(tmp_path):
    trainer, sampler = child(tmp_path, "trainer", "trainer-0", SLEEPER), child(tmp_path, "sampler-0", "sampler-0",
                                                                                REFUSER)
    outcome, lines = watch_real(tmp_path, trainer, [sampler])
    assert (outcome.reason, outcome.process, outcome.message) == (
        "permanent", "sampler-0", "sampler.model differs from the trainer"), lines
    assert sampler.starts == 1 and failure_path(tmp_path, "sampler-0").is_file()


def test_a_trainer_that_loads_for_a_minute_then_crashes_the_same_way_is_a_crash_loop(tmp_path):
    """Uptime alone made every such start 'healthy' (past up.healthy_after_s), so the budget never ran out: an OOM in
    the first step, a restore that fails the same way, restarted for ever. Progress (its beats) decides."""
    watch, clock, trainer, _, lines = fake_run(tmp_path, restart_limit_burst=2, healthy_after_s=30)
    outcome = None
    for _ in range(4):
        clock.advance(45)  # loading and compiling: no beat yet
        trainer.code = 1
        outcome = watch.check()
        if outcome is not None:
            break
        clock.advance(60)
        assert watch.check() is None  # restarted
    assert outcome is not None and outcome.reason == "gave_up" and trainer.starts == 3, lines
    # one that beat for long enough before it crashed was healthy: restarted, its budget fresh
    watch, clock, trainer, _, lines = fake_run(tmp_path, restart_limit_burst=1, healthy_after_s=30)
    for _ in range(3):
        for _ in range(3):
            clock.advance(20)
            beat_at(tmp_path, "trainer-0", clock.now)
        trainer.code = 1
        assert watch.check() is None and "restarting it in" in lines[-1]
        clock.advance(60)
        assert watch.check() is None


def test_a_trainer_job_reports_its_failing_member_not_the_ones_killed_for_it():
    class Member:
        def __init__(self, code):
            self.code = code

        def poll(self):
            return self.code

        def kill(self):
            if self.code is None:
                self.code = -9

    job = _TrainerJob.__new__(_TrainerJob)
    job.members, job._failed = [Member(None), Member(1)], None  # process 1 failed; process 0 is killed for it
    assert job.poll() == 1 and job.members[0].code == -9
    assert job.poll() == 1  # asked again (the watch does), not process 0's -9


class GoneConsole:
    """`up`'s stdout after the terminal closed (SIGHUP, ssh gone) or its `| tee` was killed: every write fails."""

    def write(self, _text):
        raise OSError(5, "Input/output error")

    def flush(self):
        raise OSError(5, "Input/output error")


def test_without_a_console_a_child_is_still_logged_whole_and_a_stop_still_reaches_it(tmp_path, monkeypatch):
    """The relay died at its first failed write: the log stopped and the child blocked on a full pipe. The stop
    handler printed before it signalled the children, so a SIGHUP on a closed terminal stopped nobody."""
    monkeypatch.setattr(sys, "stdout", GoneConsole())
    talker = child(tmp_path, "sampler-0", "sampler-0", "for i in range(20000):\n    print('x' * 20, i)")
    talker.start()
    try:
        assert talker.proc.wait(timeout=30) == 0
    finally:
        talker.kill()
    talker._relay.join(timeout=10)
    lines = (tmp_path / "logs" / "sampler-0.log").read_text().splitlines()
    assert len(lines) == 20000 and lines[-1] == "x" * 20 + " 19999"
    sleeper = child(tmp_path, "trainer", "trainer-0", SLEEPER)
    sleeper.start()
    stop = _StopSignals([sleeper])
    try:
        stop._interrupt(signal.SIGHUP, None)
        assert sleeper.proc.wait(timeout=10) == -signal.SIGTERM and stop.interrupted
    finally:
        stop.restore()
        sleeper.kill()


def test_killing_a_process_kills_what_it_started(tmp_path):
    """A vLLM sampler's engine-core and worker processes (or anything a process starts) die with it when `up` kills
    it (a stall, a job's member failing, a stop past its grace), instead of living on with their GPU memory."""
    parent = child(tmp_path, "sampler-0", "sampler-0",
                   "import subprocess, sys, time\n"
                   "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                   "print(worker.pid, flush=True)\ntime.sleep(120)")
    parent.start()
    try:
        deadline = time.monotonic() + 30
        log = tmp_path / "logs" / "sampler-0.log"
        while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        worker = int(log.read_text().split()[0])
        parent.kill()
        deadline = time.monotonic() + 10
        while pathlib.Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        state = pathlib.Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0] if pathlib.Path(
            f"/proc/{worker}").exists() else "gone"
        assert state in ("gone", "Z"), state
    finally:
        parent.kill()

