"""Rewards in a worker process with a deadline (common/tasks/reward_workers.py), with real worker processes: a reward
that never answers scores 0 within the deadline and is logged once, the worker comes back for the next call, a
reward that raises is an error naming it, what a reward prints cannot corrupt the answers, and a worker never
outlives the process that started it."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from grpo_stream.common.tasks.reward_workers import RewardWorker, WorkerClosed
from grpo_stream.common.tasks.rewards import RewardSet
from tests.support import in_thread

REWARDS = textwrap.dedent('''
    import re, time

    def forever(text, reference):
        while True:
            pass

    def backtracks(text, reference):  # the shape of the IFEval keyword that froze samplers: holds the GIL
        return float(bool(re.search(reference, text)))

    def noisy(text, reference):
        print("a reward that prints", flush=True)
        return 0.5

    def broken(text, reference):
        raise KeyError("no such field")

    def hoards(text, reference):  # allocates far more than its cap on some input (1 GiB: bounded, so a test
        kept = []                   # run without the cap scores it 1 instead of filling the machine)
        for _ in range(16):
            kept.append(bytearray(64 << 20))
        return 1.0

    def crashes(text, reference):  # a reward killed on some input (the kernel's OOM killer, a native crash)
        import os
        os._exit(9)

    def lingers(text, reference):  # answers, and leaves a thread that takes the GIL for good half a second later
        import threading

        def later():
            time.sleep(0.5)
            re.search("(a|aa)*$", "a" * 60 + "!")
        threading.Thread(target=later, daemon=True).start()
        return 1.0

    def long_error(text, reference):  # a message of `reference` MiB (the completion quoted in it, say)
        raise ValueError("x" * (int(reference) << 20))

    def starts_a_child(text, reference):  # writes its child's pid to `reference`; hangs when `text` says so
        import subprocess
        child = subprocess.Popen(["sleep", "300"])
        with open(reference, "w") as out:
            out.write(str(child.pid))
        while text == "hang":
            time.sleep(0.1)
        return 1.0
''')


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` ends (or is a zombie, dead and awaiting its reaper) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    (tmp_path / "hostile_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "hostile_rewards"


def test_a_reward_that_never_answers_scores_zero_at_its_deadline_and_the_worker_comes_back(rewards_module, caplog):
    names = {"answer_correct": 1.0, f"{rewards_module}:forever": 1.0, f"{rewards_module}:backtracks": 1.0}
    rewards = RewardSet(names)
    worker = RewardWorker(rewards.functions, deadline_s=1.0)
    try:
        assert rewards.score("#### 4", "4", worker.call) == (2.0, {
            "answer_correct": 1.0, f"{rewards_module}:forever": 0.0, f"{rewards_module}:backtracks": 1.0})
        with caplog.at_level(logging.WARNING):
            started = time.monotonic()
            total, parts = rewards.score("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!", "(a|aa)*$", worker.call)
            took = time.monotonic() - started
            rewards.score("#### 4", "4", worker.call)
        # two overruns (about 1 s each: forever and backtracks) and the worker started again twice, not the minutes the pattern takes
        assert took < 20 and parts[f"{rewards_module}:backtracks"] == 0.0 and total == 0.0
        assert worker.overruns == {f"{rewards_module}:forever": 3, f"{rewards_module}:backtracks": 1}
        overran = [r.getMessage() for r in caplog.records if "did not answer" in r.getMessage()]
        assert len(overran) == 2 and "forever" in overran[0] and "backtracks" in overran[1]  # once per reward
        assert "task.reward_timeout_s=1 s" in overran[1]
    finally:
        worker.close()


def test_a_raising_reward_is_an_error_naming_it_and_prints_do_not_corrupt_answers(rewards_module):
    rewards = RewardSet({f"{rewards_module}:noisy": 2.0})
    worker = RewardWorker(rewards.functions, deadline_s=5.0)
    try:
        assert [rewards.score("x", "y", worker.call)[0] for _ in range(3)] == [1.0, 1.0, 1.0]
        broken = RewardSet({f"{rewards_module}:broken": 1.0})
        with pytest.raises(ValueError, match=f"task.rewards.{rewards_module}:broken raised .*KeyError"):
            broken.score("x", "y", RewardWorker(broken.functions, 5.0).call)
        with pytest.raises(ValueError, match="'os:system' is not one of this run's rewards"):
            rewards.score("x", "y", lambda name, fn, t, r: worker.call("os:system", fn, t, r))
    finally:
        worker.close()


def test_a_reward_whose_worker_dies_scores_zero_and_the_worker_comes_back(rewards_module):
    rewards = RewardSet({"answer_correct": 1.0, f"{rewards_module}:crashes": 1.0})
    worker = RewardWorker(rewards.functions, deadline_s=5.0)
    try:
        for _ in range(2):
            assert rewards.score("#### 4", "4", worker.call) == (1.0, {"answer_correct": 1.0,
                                                                       f"{rewards_module}:crashes": 0.0})
        assert worker.overruns == {f"{rewards_module}:crashes": 2}
    finally:
        worker.close()


def test_the_worker_dies_with_the_process_that_started_it(tmp_path):
    script = textwrap.dedent('''
        import json, sys
        from grpo_stream.common.tasks.reward_workers import RewardWorker, WorkerClosed
        worker = RewardWorker(["answer_correct"], 5.0)
        worker.call("answer_correct", None, "4", "4")
        print(worker._process.pid, flush=True)
        sys.stdin.read()
    ''')
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
        os.kill(worker_pid, 0)  # alive while its parent is
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(worker_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"reward worker {worker_pid} outlived its parent")
    finally:
        parent.kill()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_what_a_reward_started_dies_with_a_sampler_killed_by_sigkill(rewards_module, tmp_path):
    """A SIGKILLed sampler sends no kill to its worker's group, and PR_SET_PDEATHSIG ends the worker alone: what a
    reward started (here `sleep 300`) was re-parented to init and outlived the sampler."""
    pid_file = tmp_path / "child.pid"
    script = textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from grpo_stream.common.tasks.reward_workers import RewardWorker
        worker = RewardWorker(["{rewards_module}:starts_a_child"], 30.0)
        print(worker.call("{rewards_module}:starts_a_child", None, "answer", {str(pid_file)!r}), flush=True)
        sys.stdin.read()
    ''')
    sampler = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    child = None
    try:
        assert sampler.stdout.readline().strip() == "1.0"
        child = int(pid_file.read_text())
        sampler.kill()
        sampler.wait()
        assert _gone(child), f"the reward's child {child} outlived the SIGKILLed sampler"
    finally:
        sampler.kill()
        sampler.wait()
        if child is not None:
            _kill_if_sleep(child)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_what_a_reward_started_dies_with_its_worker_at_the_deadline_and_at_close(rewards_module, tmp_path):
    name = f"{rewards_module}:starts_a_child"
    worker = RewardWorker([name], deadline_s=1.0)
    pids = []
    try:
        for text, stop in (("hang", lambda: None), ("answer", worker.close)):
            pid_file = tmp_path / f"{text}.pid"
            assert worker.call(name, None, text, str(pid_file)) == (0.0 if text == "hang" else 1.0)
            stop()
            pids.append(int(pid_file.read_text()))
            assert _gone(pids[-1]), f"the {text} reward's child {pids[-1]} outlived its worker"
    finally:
        worker.close()
        for pid in pids:
            _kill_if_sleep(pid)


def _kill_if_sleep(pid: int) -> None:
    """A child that outlived the check (a failure): ours only while it is still that `sleep 300`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if cmdline.read() == b"sleep\x00300\x00":
                os.kill(pid, 9)
    except (FileNotFoundError, ProcessLookupError):
        pass


def test_a_reward_that_allocates_without_bound_scores_zero_and_the_worker_comes_back(rewards_module, caplog):
    """Nothing capped a reward's memory: one that allocated without bound on some input ran until the host's OOM
    killer chose a process, the sampler maybe. Past task.reward_memory_mb it gets a MemoryError, answered as a
    death: score 0, logged once naming the setting, and the worker starts again for the next call."""
    rewards = RewardSet({"answer_correct": 1.0, f"{rewards_module}:hoards": 1.0})
    worker = RewardWorker(rewards.functions, deadline_s=30.0, memory_mb=256)
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                assert rewards.score("#### 4", "4", worker.call) == (1.0, {"answer_correct": 1.0,
                                                                           f"{rewards_module}:hoards": 0.0})
        assert worker.overruns == {f"{rewards_module}:hoards": 2}
        said = [r.getMessage() for r in caplog.records if "hoards" in r.getMessage()]
        assert len(said) == 1 and "allocated past task.reward_memory_mb=256" in said[0]
    finally:
        worker.close()


def _kill_worker(worker: RewardWorker) -> None:
    """Its process group, without its locks (a call that never returns holds them)."""
    process = worker._process
    if process is not None and process.returncode is None:
        os.killpg(process.pid, signal.SIGKILL)


def test_a_worker_that_stops_reading_is_an_overrun_at_the_deadline_not_a_frozen_sampler(rewards_module):
    """The deadline covered the answer only: sending a completion longer than a pipe holds (64 KiB) to a worker
    whose reading thread could not run (a thread a reward left holding the GIL) blocked the sampler's scoring thread
    for good."""
    worker = RewardWorker([f"{rewards_module}:lingers", "answer_correct"], deadline_s=2.0)
    try:
        assert worker.call(f"{rewards_module}:lingers", None, "x", "y") == 1.0
        time.sleep(1.5)  # the lingering thread holds the GIL by now
        done, value = in_thread(lambda: worker.call("answer_correct", None, "#### 4 " + "z" * (1 << 20), "4"), 20)
        assert done and value == 0.0 and worker.overruns == {"answer_correct": 1}
        assert worker.call("answer_correct", None, "#### 4", "4") == 1.0  # a new worker
    finally:
        _kill_worker(worker)
        worker.close()


def test_a_reward_error_of_any_length_comes_back_cut_at_once(rewards_module):
    """A reward that raised with a long message had all of it sent back, read by `bytes +=` (quadratic: 15 s of
    the sampler's CPU for 32 MiB, up to task.reward_memory_mb held twice over)."""
    worker = RewardWorker([f"{rewards_module}:long_error"], deadline_s=30.0)
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="ValueError: xxx") as err:
            worker.call(f"{rewards_module}:long_error", None, "x", "16")
        assert len(str(err.value)) < 4096 and time.monotonic() - started < 10
    finally:
        worker.close()


def test_close_stops_a_call_in_flight_and_starts_no_worker_again(rewards_module):
    """close() waited for the call in flight (a sampler's stop up to task.reward_timeout_s), and the next call
    started a new worker after it. Now the call in flight raises WorkerClosed at once (not scored 0) and so does
    every later one."""
    name = f"{rewards_module}:forever"
    worker = RewardWorker([name], deadline_s=60.0)
    try:
        out = []
        calling = threading.Thread(target=lambda: out.append(in_thread(lambda: worker.call(name, None, "x", "y"), 90)))
        calling.start()
        time.sleep(3)  # the worker started, the call in its loop
        done, _ = in_thread(worker.close, 10)
        calling.join(10)
        assert done, "close() waited for the call in flight"
        assert out and out[0][0] and isinstance(out[0][1], WorkerClosed) and not worker.overruns
        with pytest.raises(WorkerClosed):
            worker.call(name, None, "x", "y")
        assert worker._process is None
    finally:
        _kill_worker(worker)


def test_a_reward_that_exits_or_whose_error_cannot_be_said_is_an_error_naming_it(tmp_path, monkeypatch, caplog):
    """A reward that calls sys.exit() (exit(), argparse's error) on some input, or raises an exception whose str()
    raises, ended the worker: scored 0 as if killed for memory, for ever and logged once, where in-process it is an
    error naming the reward (RewardSet.score). Each is that error now, and the worker keeps serving."""
    (tmp_path / "quitting_rewards.py").write_text(textwrap.dedent('''
        import sys

        class Unsayable(Exception):
            def __str__(self):
                raise RuntimeError("no message")

        def quits(text, reference):
            sys.exit("cannot read " + text)

        def unsayable(text, reference):
            raise Unsayable()

        def fine(text, reference):
            return 0.25
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    names = [f"quitting_rewards:{name}" for name in ("quits", "unsayable", "fine")]
    worker = RewardWorker([*names, "answer_correct"], deadline_s=30.0)
    try:
        with caplog.at_level(logging.WARNING):
            with pytest.raises(ValueError, match="task.rewards.quitting_rewards:quits raised RuntimeError: "
                                                 "SystemExit: cannot read x"):
                RewardSet({names[0]: 1.0}).score("x", "y", worker.call)
            with pytest.raises(ValueError, match="quitting_rewards:unsayable raised RuntimeError: Unsayable: "):
                RewardSet({names[1]: 1.0}).score("x", "y", worker.call)
        assert worker.call(names[2], None, "x", "y") == 0.25
        assert not worker.overruns and "made its worker exit" not in caplog.text
    finally:
        worker.close()
