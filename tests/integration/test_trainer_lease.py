"""One trainer per run (issue 41, finding 5): the trainer's lease and fencing number in a real Redis.

The fault: two trainers on one run (a second `up`, a trainer paused or cut off past its lease while a new one
started) both read as consumer `trainer-0` and both settle, log and compact. Here a stale trainer (an older fence)
is refused every write and its groups go to the newer trainer; a dead holder is taken over at once; a live one is
waited for; a real process that finds itself fenced off stops at once with a clear message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis

from grpo_stream.common.rollouts.buffer import Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, connect
from grpo_stream.common.rollouts.trainer_lease import EXIT_FENCED, LeaseDamaged, StaleTrainer, TrainerLease
from grpo_stream.common.runtime.backoff import StopRequested
from tests.e2e.test_up import ROOT
from tests.support import wait_for

pytestmark = pytest.mark.redis


def groups(n: int, start: int = 0) -> list[Incoming]:
    return [Incoming(f"run/s0/{i}", "s0", 0, i, f"g{i}".encode()) for i in range(start, start + n)]


def trainer_buffer(url: str, run: str) -> RedisStreamBuffer:
    return RedisStreamBuffer(connect(url, 5), run)


def test_a_stale_trainer_cannot_settle_append_log_or_compact_and_its_groups_go_to_the_newer_one(shared_redis,
                                                                                                run_name):
    ingest = trainer_buffer(shared_redis.url, run_name)  # a standalone ingest: no fence
    old, new = trainer_buffer(shared_redis.url, run_name), trainer_buffer(shared_redis.url, run_name)
    refused: list[str] = []
    # the old trainer stops renewing (paused, or cut off from Redis) past its 1 s lease
    stale = TrainerLease.take(old, 1.0, None, on_stale=refused.append, renew=False)
    ingest.append_many(groups(4), max_groups=100)
    read = old.read(4, block_ms=100)
    assert len(read) == 4
    started = time.monotonic()
    fresh = TrainerLease.take(new, 5.0, None, on_stale=refused.append, renew=False)  # waits for the old lease
    assert time.monotonic() - started >= 0.3 and fresh.fence > stale.fence
    before = ingest.counters()

    records = [(e.entry_id, e.group_id, "trained", 1) for e in read]
    writes = {"settle": lambda: old.settle(records), "append": lambda: old.append_many(groups(2, 10), 100),
              "log_step": lambda: old.log_step("old", 1, [e.group_id for e in read]),
              "log_checkpoint": lambda: old.log_checkpoint("old", 1), "set_held": lambda: old.set_held(4),
              "log_trainer": lambda: old.log_trainer("old", 0, ""), "compact_audit": lambda: old.compact_audit(1),
              "renew": stale.renew}
    for what, write in writes.items():
        with pytest.raises(StaleTrainer, match=f"fence {stale.fence} but the run is at fence {fresh.fence}"):
            write()
        assert ingest.counters() == before, what  # nothing written
    assert len(refused) == 7  # every refused buffer write told the trainer (its handler stops the process)
    assert not old.client.exists(old.k["audit:steps"], old.k["audit:checkpoints"], old.k["held"])

    # the newer trainer takes back what the stale one read and never settled, and settles it
    again = new.read(10, block_ms=100)
    assert sorted(e.group_id for e in again) == sorted(e.group_id for e in read)
    assert new.settle([(e.entry_id, e.group_id, "trained", 1) for e in again]) == 4
    new.log_step("new", 1, [e.group_id for e in again])
    assert ingest.counters()["trained"] == 4
    fresh.release()
    assert not new.client.exists(new.k["trainer:lease"])


def test_a_redis_that_lost_its_data_never_hands_a_running_trainers_fence_to_a_new_one():
    """A Redis restarted without its data (no append-only file) forgot the fence key: counted from 1 again, a new
    trainer got the very fence the running one held, and both trained and wrote the run. The running one's writes
    are refused, naming the loss (not "a newer trainer") before a new trainer starts and that trainer after."""
    server = EmbeddedRedis().start()  # no append-only file: a restart loses every key
    try:
        refused: list[str] = []
        old = trainer_buffer(server.url, "run")
        stale = TrainerLease.take(old, 30.0, None, on_stale=refused.append, renew=False)
        server.kill()
        server.start()
        with pytest.raises(StaleTrainer, match=f"holds fence {stale.fence} but the run has no fence at all: Redis "
                                               "lost the keys of this run"):
            old.log_step("old", 1, ["run/s0/0"])
        fresh = TrainerLease.take(trainer_buffer(server.url, "run"), 30.0, None, renew=False)
        assert fresh.fence != stale.fence
        with pytest.raises(StaleTrainer, match=f"fence {stale.fence} but the run is at fence {fresh.fence}"):
            old.log_step("old", 1, ["run/s0/0"])
        assert len(refused) == 2 and not old.client.exists(old.k["audit:steps"])
    finally:
        server.stop()


def test_a_damaged_fence_is_refused_naming_the_key_and_the_fix(shared_redis, run_name):
    buf = trainer_buffer(shared_redis.url, run_name)
    buf.client.set(buf.k["trainer:fence"], "x")
    with pytest.raises(LeaseDamaged, match=f"{buf.k['trainer:fence']} holds \"x\", not a fencing number.*"
                                                  f"DEL {buf.k['trainer:fence']}"):
        TrainerLease.take(buf, 1.0, None, renew=False)
    assert not buf.client.exists(buf.k["trainer:lease"])


def test_a_lease_that_lapsed_is_its_trainers_again_while_no_newer_one_started(shared_redis, run_name):
    """A trainer SIGSTOPped (or cut off from Redis) longer than its lease goes on when it resumes, if nobody took
    the run meanwhile: the chaos schedule pauses the trainer for up to 20 s."""
    buf = trainer_buffer(shared_redis.url, run_name)
    lease = TrainerLease.take(buf, 1.0, None, renew=False)
    wait_for(lambda: not buf.client.exists(buf.k["trainer:lease"]), 5, "the lease to lapse")
    lease.renew()
    assert buf.client.pttl(buf.k["trainer:lease"]) > 0
    trainer_buffer(shared_redis.url, run_name).append_many(groups(1), 10)
    entry = buf.read(1, block_ms=100)[0]
    assert buf.settle([(entry.entry_id, entry.group_id, "trained", 1)]) == 1


def test_a_live_holder_is_waited_for_and_a_stop_ends_the_wait(shared_redis, run_name):
    holder = TrainerLease.take(trainer_buffer(shared_redis.url, run_name), 30.0, None)  # renewed: alive
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    with pytest.raises(StopRequested, match="trainer lease"):
        TrainerLease.take(trainer_buffer(shared_redis.url, run_name), 30.0, stop)
    assert time.monotonic() - started < 3.0
    holder.release()


LEASE_HOLDER = """
import sys, time
from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, connect
from grpo_stream.common.rollouts.trainer_lease import TrainerLease
import logging; logging.basicConfig(level=logging.INFO, stream=sys.stdout)
lease = TrainerLease.take(RedisStreamBuffer(connect(sys.argv[1], 5), sys.argv[2]), float(sys.argv[3]), None)
print("fence", lease.fence, flush=True)
time.sleep(600)
"""


def holder_process(url: str, run: str, ttl_s: float) -> tuple[subprocess.Popen, int]:
    """A process that took the run's lease and renews it (a trainer, less the training); (it, its fence)."""
    proc = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, url, run, str(ttl_s)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    for line in proc.stdout:  # ends when the process does
        seen.append(line)
        if line.startswith("fence "):
            return proc, int(line.split()[1])
    raise AssertionError(f"the lease holder exited with code {proc.wait()}: {''.join(seen)}")


def test_a_holder_killed_on_this_machine_is_taken_over_at_once(shared_redis, run_name):
    proc, fence = holder_process(shared_redis.url, run_name, 60.0)
    proc.kill()
    proc.wait()
    started = time.monotonic()
    lease = TrainerLease.take(trainer_buffer(shared_redis.url, run_name), 60.0, None, renew=False)
    assert time.monotonic() - started < 5.0 and lease.fence > fence  # not the 60 s of its lease


def test_a_trainer_process_fenced_off_stops_at_once_with_the_reason(shared_redis, run_name):
    """A real process holding the lease is paused past it, a newer trainer takes the run, and when the old one
    resumes its renewal is refused: it exits with EXIT_FENCED and says why, writing nothing more."""
    proc, fence = holder_process(shared_redis.url, run_name, 1.0)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        newer = TrainerLease.take(trainer_buffer(shared_redis.url, run_name), 30.0, None, renew=False)
        assert newer.fence > fence
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_FENCED, out
    assert f"holds fence {fence} but the run is at fence {newer.fence}" in out and "stopping now" in out


def _before_exec(monkeypatch, fault) -> None:
    """Make `fault()` happen just before a pipeline executes (compaction's MULTI/EXEC: its only pipeline)."""
    execute = redis.client.Pipeline.execute

    def execute_after_fault(pipe, *args, **kwargs):
        fault()
        return execute(pipe, *args, **kwargs)
    monkeypatch.setattr(redis.client.Pipeline, "execute", execute_after_fault)


@pytest.mark.parametrize("fault", ["connection-lost", "newer-trainer"])
def test_a_connection_lost_during_compaction_is_retried_and_only_a_moved_fence_is_a_newer_trainer(
        redis_server, run_name, monkeypatch, fault):
    """redis-py raises WatchError both when the WATCHed fence changed and when the connection dropped while it
    was WATCHed (Redis restarted): the first is a newer trainer, the second a passing failure to retry. Seen: a
    supervised run whose Redis was SIGKILLed mid-compaction stopped its trainer as stale (exit 3)."""
    from grpo_stream.common.rollouts.redis_errors import BufferUnavailable

    buf = trainer_buffer(redis_server.url, run_name)
    refused: list[str] = []
    lease = TrainerLease.take(buf, 30.0, None, on_stale=refused.append, renew=False)
    buf.log_trainer("a", 0, "")
    buf.append_many(groups(4), max_groups=100)
    read = buf.read(4, block_ms=100)
    buf.log_step("a", 1, [e.group_id for e in read])
    buf.settle([(e.entry_id, e.group_id, "trained", 1) for e in read])
    buf.log_checkpoint("a", 1)
    other = connect(redis_server.url, 5)
    faults = {"connection-lost": lambda: other.client_kill_filter(_type="normal", skipme=True),
              "newer-trainer": lambda: other.incr(buf.k["trainer:fence"])}
    raised = {"connection-lost": (BufferUnavailable, "connection to Redis was lost during compaction"),
              "newer-trainer": (StaleTrainer, f"fence moved past {lease.fence} during compaction")}
    with monkeypatch.context() as patch:
        _before_exec(patch, faults[fault])
        with pytest.raises(raised[fault][0], match=raised[fault][1]):
            buf.compact_audit(1)
    if fault == "newer-trainer":
        assert len(refused) == 1  # the trainer is told to stop
        return
    assert not refused  # the trainer goes on, and its next attempt compacts
    assert buf.compact_audit(1).through_step == 1
    assert int(buf.client.hget(buf.k["audit:compacted"], "through_step")) == 1


@pytest.mark.parametrize("value, ttl_ms", [('7 {"pid": 1, "host": "elsewhere"}', None), ("not a lease", 60_000),
                                           ("7 [1, 2]", 60_000)])
def test_a_lease_no_trainer_wrote_is_refused_naming_the_key_and_the_fix(shared_redis, run_name, value, ttl_ms):
    """A lease value without a TTL (every trainer's lease has one) never ends, and one that is not 'FENCE HOLDER'
    names no process: the trainer waited forever saying another trainer runs (or raised AttributeError)."""
    buf = trainer_buffer(shared_redis.url, run_name)
    key = buf.k["trainer:lease"]
    buf.client.set(key, value, px=ttl_ms)
    stop = threading.Event()
    timer = threading.Timer(3.0, stop.set)  # without the check the wait only ends here
    timer.start()
    try:
        with pytest.raises(LeaseDamaged, match=f"{key} .*DEL {key}"):
            TrainerLease.take(buf, 1.0, stop, renew=False)
    finally:
        timer.cancel()
    assert buf.client.get(key) == value.encode() and not buf.client.exists(buf.k["trainer:fence"])
