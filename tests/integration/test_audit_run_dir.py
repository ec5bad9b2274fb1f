"""`grpo-stream audit RUN_DIR` finds the run's Redis, and starts one of its own on the run's data only when no run
holds the directory: a second redis-server on a live run's append-only file would corrupt it, and rewrite the
password file the run's clients read."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from grpo_stream.common.rollouts.buffer import RUN_FILE, Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_protection import read_password
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, connect, free_port
from grpo_stream.up.run_lock import RunLock

pytestmark = pytest.mark.redis


def audit(run_dir, env=None):
    env = {k: v for k, v in os.environ.items() if k != "GRPO_STREAM_REDIS_PASSWORD"} | (env or {})
    return subprocess.run([sys.executable, "-m", "grpo_stream", "audit", str(run_dir)], capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.fixture
def live_run(tmp_path):
    """A run as `up` leaves it while it runs: the directory locked, its protected Redis on RUN_DIR/redis holding
    three accepted groups."""
    lock = RunLock.acquire(tmp_path, "up")
    server = EmbeddedRedis(data_dir=tmp_path / "redis", protected=True).start()
    buffer = RedisStreamBuffer(connect(server.url, 5, **server.client_options()), "r")
    buffer.append_many([Incoming(f"r/s0/{i}", "s0", 0, i, b"g") for i in range(3)], 10)
    (tmp_path / RUN_FILE).write_text(json.dumps({"run": "r", "redis_url": server.url}))
    try:
        yield tmp_path, server, lock
    finally:
        server.stop()
        lock.release()


def test_a_live_runs_redis_that_does_not_answer_gets_no_second_server(live_run):
    run_dir, server, _ = live_run
    password = read_password(run_dir / "redis")
    # the run's Redis does not answer in time (slow, loading): here, the run file names a port nobody serves
    (run_dir / RUN_FILE).write_text(json.dumps({"run": "r", "redis_url": f"redis://127.0.0.1:{free_port()}/0"}))
    out = audit(run_dir)
    assert out.returncode != 0 and "the run is still live, so audit starts no Redis of its own" in out.stderr, out
    assert read_password(run_dir / "redis") == password  # the run's clients still find their password
    assert connect(server.url, 5, **server.client_options()).xlen("grpo-stream:r:rollouts") == 3


def test_a_wrong_password_is_an_error_not_a_reason_to_start_a_server(live_run):
    run_dir, _, _ = live_run
    password = read_password(run_dir / "redis")
    out = audit(run_dir, {"GRPO_STREAM_REDIS_PASSWORD": "another-deployments-password"})
    assert out.returncode != 0 and "authentication failed" in out.stderr, out
    assert read_password(run_dir / "redis") == password


def test_a_stopped_runs_data_is_audited_by_a_redis_of_its_own(live_run):
    run_dir, server, lock = live_run
    server.stop()
    lock.release()
    out = audit(run_dir)
    assert out.returncode == 0 and "run r: 3 groups accepted" in out.stdout, out
    RunLock.acquire(run_dir, "up").release()  # and audit let the directory go


def test_audits_own_redis_holds_the_run_directory_while_it_lives(live_run):
    """Audit's own redis-server on a stopped run's data held no lock of its own: were audit killed, its Redis lived
    on (until its death signal) on the run's AOF with the directory free for an `up` to start a second one. (In a
    process of its own, as audit runs: its death signal is a preexec_fn, so subprocess forks without vfork, and in a
    pytest worker an earlier test's gRPC threads would be restarted in the child by gRPC's fork handlers.)"""
    run_dir, server, lock = live_run
    server.stop()
    lock.release()
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from grpo_stream.reports.audit import _client_for
        client, _, (own, own_lock) = _client_for(pathlib.Path({str(run_dir)!r}), None)
        print(own.proc.pid, own_lock.path, flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        redis_pid, lock_path = child.stdout.readline().split(maxsplit=1)
        held = {os.path.realpath(f"/proc/{redis_pid}/fd/{fd}") for fd in os.listdir(f"/proc/{redis_pid}/fd")}
        assert lock_path.strip() in held  # the server holds the locked file too
    finally:
        child.kill()
        child.wait()
