"""What `up` does with its children beyond their exit codes: a process that exits leaves nothing it started running
(its process group is killed), and a restart that fails to start (a fork refused, a Redis whose port another
process took meanwhile) is a failure counted against the restart budget, not an exception that ends `up` with its
processes killed unstopped. Real child processes and a real embedded Redis where the bug needs them."""

from __future__ import annotations

import errno
import os
import pathlib
import signal
import socket
import sys
import threading
import time

import pytest
import redis

from grpo_stream.common.config.process import UpSection
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis
from grpo_stream.up.processes import ProcessSpec
from grpo_stream.up import run as up_run
from grpo_stream.up.relay import QueuedConsole
from grpo_stream.up.run import _Child, _RedisUnit, _StopSignals
from grpo_stream.up.supervise import Watch
from tests.support import FakeClock
from tests.unit.test_supervise_watch import FakeUnit

# starts a worker (as vLLM starts its engine core, or a tool its helper), says its pid, then ends: by itself with
# code 1 (a crash), or with code 0 on SIGTERM (a clean stop that forgot its worker)
STARTER = ("import signal, subprocess, sys, time\n"
           "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
           "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
           "print(worker.pid, flush=True)\nEND")


def running(pid: int) -> bool:
    stat = pathlib.Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie waits for a reaper, it runs nothing
    except OSError:
        return False


def started_worker(tmp_path, end: str) -> tuple[_Child, int]:
    (tmp_path / "logs").mkdir(exist_ok=True)
    child = _Child(ProcessSpec("sampler-0", (sys.executable, "-c", STARTER.replace("END", end)), dict(os.environ),
                               "sampler", "sampler-0"), tmp_path / "logs")
    child.start()
    log, deadline = tmp_path / "logs" / "sampler-0.log", time.monotonic() + 30
    while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return child, int(log.read_text().split()[0])


def gone_soon(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running(pid)


@pytest.mark.parametrize("end", ["sys.exit(1)", "time.sleep(120)"])
def test_what_an_ended_process_started_does_not_outlive_it(tmp_path, end):
    """A sampler that crashed (the watch sees its exit) or stopped cleanly on SIGTERM without stopping its worker:
    the worker lived on after `up` (holding its GPU memory against the restarted sampler, and the relay's pipe)."""
    child, worker = started_worker(tmp_path, end)
    try:
        if end.startswith("sys.exit"):
            deadline = time.monotonic() + 30
            while child.poll() is None and time.monotonic() < deadline:  # as the watch polls it
                time.sleep(0.05)
            assert child.poll() == 1
        else:
            child.terminate()
            assert child.wait(timeout_s=30) == 0
        assert gone_soon(worker)
    finally:
        child.kill()
        if running(worker):
            os.kill(worker, 9)


def refusing_watch(tmp_path, refusals: int, burst: int):
    """A watch whose sampler crashed, and whose next `refusals` starts fail as a fork refused for memory does."""
    clock, lines = FakeClock(), []
    trainer, sampler = FakeUnit("trainer", "trainer-0"), FakeUnit("sampler-0", "sampler-0")
    watch = Watch(UpSection(restart_backoff_s=1, restart_limit_burst=burst), tmp_path, trainer, [sampler],
                  log=lines.append, clock=clock, wall=clock)
    for unit in (trainer, sampler):
        watch.launch(unit)
    left = [refusals]

    def start():
        if left[0]:
            left[0] -= 1
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        FakeUnit.start(sampler)
    sampler.start, sampler.code = start, 1
    assert watch.check() is None and "restarting it in" in lines[-1]
    return watch, clock, sampler, lines


def test_a_restart_that_cannot_start_is_retried_and_runs_once_it_can(tmp_path):
    watch, clock, sampler, lines = refusing_watch(tmp_path, refusals=1, burst=5)
    clock.advance(2)
    assert watch.check() is None  # before the fix: the OSError ended the watch, and with it `up`
    assert lines[-1].startswith("[up] sampler-0 could not be started ([Errno 12] Cannot allocate memory); "
                                "restarting it in")
    clock.advance(3)
    assert watch.check() is None and sampler.starts == 2 and sampler.poll() is None


def test_a_process_that_keeps_failing_to_start_stops_the_run_past_its_budget_saying_why(tmp_path):
    watch, clock, sampler, lines = refusing_watch(tmp_path, refusals=10, burst=2)
    clock.advance(2)
    assert watch.check() is None
    clock.advance(3)
    outcome = watch.check()
    assert (outcome.reason, outcome.process) == ("gave_up", "sampler-0") and sampler.starts == 1
    assert "could not be started ([Errno 12] Cannot allocate memory)" in outcome.message


def test_a_redis_whose_port_was_taken_while_it_was_down_is_retried_until_it_starts(tmp_path):
    server = EmbeddedRedis(data_dir=tmp_path / "redis").start()
    trainer, lines = FakeUnit("trainer", "trainer-0"), []
    watch = Watch(UpSection(restart_backoff_s=0.1, restart_backoff_max_s=0.2), tmp_path, trainer,
                  [_RedisUnit(server, lambda: False)], log=lines.append)
    watch.launch(trainer)
    squatter = socket.socket()
    try:
        server.kill()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", server.port))
        squatter.listen()
        deadline = time.monotonic() + 30
        while not any("could not be started" in line for line in lines) and time.monotonic() < deadline:
            assert watch.check() is None  # before the fix: RedisConnectError out of the watch
            time.sleep(0.05)
        assert any(line.startswith("[up] redis-server could not be started (") and "Address already in use" in line
                   for line in lines), lines
        squatter.close()
        while server.proc.poll() is not None and time.monotonic() < deadline:
            assert watch.check() is None
            time.sleep(0.05)
        assert redis.Redis(port=server.port).ping()
    finally:
        squatter.close()
        server.stop()


def test_a_stop_signal_landing_inside_a_console_write_does_not_deadlock_up(monkeypatch):
    """A signal handler runs on the main thread between two of its bytecodes: one that landed while `up` wrote one of
    its own lines (the console's lock held) wrote its "[up] signal N" line from the handler, waited for that lock for
    ever, and `up` hung with its processes stopped (reproduced with real SIGTERMs: /tmp/rev-up/sig_deadlock.py)."""
    console = QueuedConsole()
    monkeypatch.setattr(up_run, "CONSOLE", console)
    stop = _StopSignals([])
    try:
        def main_thread_inside_a_write():
            with console._lock:  # where CONSOLE.write holds it
                stop._interrupt(signal.SIGTERM, None)

        handler = threading.Thread(target=main_thread_inside_a_write, daemon=True)
        handler.start()
        handler.join(timeout=10)
        assert not handler.is_alive(), "the stop handler waited for the console's lock"
        assert stop.interrupted
        stop.say_received()
        console.drain()
        assert console._lines.unfinished_tasks == 0
    finally:
        stop.restore()


def test_a_process_whose_program_is_missing_stops_the_run_at_once_naming_it(tmp_path):
    """sampler.python naming an interpreter that is not there: every start failed the same way, restarted with
    back-off until the budget ran out (23 s with the defaults) and `up` exited 1 as if for a crash loop."""
    (tmp_path / "logs").mkdir()
    missing = str(tmp_path / "venv-vllm" / "bin" / "python")
    sampler = _Child(ProcessSpec("sampler-0", (missing, "-m", "grpo_stream", "sampler"), dict(os.environ), "sampler",
                                 "sampler-0"), tmp_path / "logs")
    lines = []
    watch = Watch(UpSection(), tmp_path, FakeUnit("trainer", "trainer-0"), [sampler], log=lines.append)
    outcome = watch.launch(sampler)
    assert outcome is not None and (outcome.reason, outcome.process) == ("permanent", "sampler-0"), lines
    assert missing in outcome.message and "sampler.python" in outcome.message and sampler.starts == 0
    assert not watch.supervisor.waiting("sampler-0")


DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"


def test_samplers_that_ignore_sigterm_share_one_stop_deadline(tmp_path, monkeypatch):
    """Each sampler was waited for in turn, each with its own 20 s: 3 samplers hung in a C call (or ignoring
    SIGTERM) held a stopped `up` 60 s past its trainer, 8 of them 160 s (past a pod's grace, which then SIGKILLs `up`
    before it completes summary.json)."""
    monkeypatch.setattr(up_run, "STOP_S", 2.0)
    (tmp_path / "logs").mkdir()
    trainer = _Child(ProcessSpec("trainer", (sys.executable, "-c", "import time; time.sleep(120)"), dict(os.environ),
                                 "trainer", "trainer-0"), tmp_path / "logs")
    samplers = [_Child(ProcessSpec(f"sampler-{i}", (sys.executable, "-c", DEAF), dict(os.environ), "sampler",
                                   f"sampler-{i}"), tmp_path / "logs") for i in range(3)]
    try:
        for unit in (trainer, *samplers):
            unit.start()
        for unit in samplers:  # each ignores SIGTERM from here on
            log, deadline = tmp_path / "logs" / f"{unit.name}.log", time.monotonic() + 30
            while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
                time.sleep(0.05)
        for unit in (trainer, *samplers):
            unit.terminate()  # as after Ctrl-C
        started = time.monotonic()
        trainer_code, codes = up_run._wind_down(trainer, [], samplers, grace_s=5)
        took = time.monotonic() - started
        assert trainer_code == -signal.SIGTERM and codes == {f"sampler-{i}": -9 for i in range(3)}
        assert took < 2 * up_run.STOP_S, f"{took:.1f}s: the samplers were waited for one after another"
    finally:
        for unit in (trainer, *samplers):
            unit.kill()


def test_samplers_told_to_stop_get_the_stop_deadline_once_though_the_trainer_exits_0(tmp_path, monkeypatch):
    """On Ctrl-C the trainer checkpoints and exits 0, as when it finishes: samplers already told to stop were then
    waited for as after a finished run (30 s for them to stop by themselves, "still running 30s after the trainer
    finished; stopping it", 30 s more), up to 60 s where docs/supervision.md gives them 20 s."""
    waits, said = [], []
    monkeypatch.setattr(up_run, "STOP_S", 1.0)
    monkeypatch.setattr(up_run, "FINISH_S", 300.0)  # waited for, the test would take minutes
    real_wait = up_run._wait_together
    monkeypatch.setattr(up_run, "_wait_together", lambda children, timeout_s, kill=False: (
        waits.append((timeout_s, kill)), real_wait(children, timeout_s, kill))[1])
    monkeypatch.setattr(up_run, "_say", said.append)
    (tmp_path / "logs").mkdir()
    trainer = _Child(ProcessSpec("trainer", (sys.executable, "-c", STARTER.replace("END", "time.sleep(120)")),
                                 dict(os.environ), "trainer", "trainer-0"), tmp_path / "logs")
    sampler = _Child(ProcessSpec("sampler-0", (sys.executable, "-c", DEAF), dict(os.environ), "sampler", "sampler-0"),
                     tmp_path / "logs")
    try:
        for unit in (trainer, sampler):
            unit.start()
        log, deadline = tmp_path / "logs" / "sampler-0.log", time.monotonic() + 30
        while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        for unit in (trainer, sampler):
            unit.terminate()  # as after Ctrl-C: the trainer exits 0 on SIGTERM (STARTER), the sampler hangs on
        trainer_code, codes = up_run._wind_down(trainer, [], [sampler], grace_s=30, stopping=True)
        assert trainer_code == 0 and codes == {"sampler-0": -signal.SIGKILL}
        assert waits[0] == (up_run.STOP_S, True), waits
        assert not any("after the trainer finished" in line for line in said), said
    finally:
        for unit in (trainer, sampler):
            unit.kill()


def test_a_second_stop_signal_kills_every_process_at_once(tmp_path, monkeypatch):
    """A second Ctrl-C (or SIGTERM) while `up` waited for its processes to stop only sent SIGTERM again: `up` went on
    waiting up.stop_grace_s (120 s by default) for a trainer that did not stop, and STOP_S for the others. Now it
    kills them (their process groups) at once, and says so."""
    lines = []
    monkeypatch.setattr(up_run, "_say", lines.append)
    (tmp_path / "logs").mkdir()
    trainer = _Child(ProcessSpec("trainer", (sys.executable, "-c", DEAF), dict(os.environ), "trainer", "trainer-0"),
                     tmp_path / "logs")
    stop = _StopSignals([trainer], say=lines.append)
    try:
        trainer.start()
        log, deadline = tmp_path / "logs" / "trainer.log", time.monotonic() + 30
        while not (log.exists() and log.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)  # it ignores SIGTERM from here on
        stop._interrupt(signal.SIGINT, None)  # as the handler runs: Ctrl-C, then Ctrl-C again while `up` waits
        stop._interrupt(signal.SIGINT, None)
        assert trainer.proc.wait(timeout=60) == -signal.SIGKILL
        stop.say_received()
        assert "stopping every process" in lines[0] and "killing every process now" in lines[1]
    finally:
        stop.restore()
        trainer.kill()


# stops on SIGTERM, then shuts its interpreter down slowly (as JAX's clients are torn down), saying when it is there
SLOW_EXIT = ("import signal, sys, time\nstop = []\nsignal.signal(signal.SIGTERM, lambda *_: stop.append(1))\n"
             "class Teardown:\n    def __del__(self):\n        print('finalizing', flush=True)\n        time.sleep(3)\n"
             "sys.modules['teardown'] = type(sys)('teardown')\nsys.modules['teardown'].held = Teardown()\n"
             "print('running', flush=True)\nwhile not stop:\n    time.sleep(0.02)\n")


def test_a_sampler_already_stopping_is_not_told_again_and_exits_0(tmp_path):
    """Ctrl-C (or SIGHUP) told every process to stop; once the trainer had checkpointed, `up` told the samplers
    again. A sampler by then in its interpreter's shutdown (where Python has put SIGTERM's default back) died of the
    second SIGTERM: summary.json said -15 for a sampler that stopped cleanly."""
    (tmp_path / "logs").mkdir()
    trainer = _Child(ProcessSpec("trainer", (sys.executable, "-c", STARTER.replace("END", "time.sleep(120)")),
                                 dict(os.environ), "trainer", "trainer-0"), tmp_path / "logs")
    sampler = _Child(ProcessSpec("sampler-0", (sys.executable, "-c", SLOW_EXIT), dict(os.environ), "sampler",
                                 "sampler-0"), tmp_path / "logs")
    log = tmp_path / "logs" / "sampler-0.log"

    def said(word: str) -> None:
        deadline = time.monotonic() + 30
        while not (log.exists() and word in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
    try:
        for unit in (trainer, sampler):
            unit.start()
        said("running")
        for unit in (trainer, sampler):
            unit.terminate()  # as after Ctrl-C
        said("finalizing")
        trainer_code, codes = up_run._wind_down(trainer, [], [sampler], grace_s=30, stopping=True)
        assert trainer_code == 0 and codes == {"sampler-0": 0}
    finally:
        for unit in (trainer, sampler):
            unit.kill()
