"""Every retry loop honours a stop (issue 41, finding 10): with Redis down, a stop ends the waits at once instead of
after the back-off, or never (a stopping `up` does not restart Redis; the trainer used to retry it for 120 s until
`up` killed it). Against a real Redis that was killed, and a real trainer process."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, RedisConnectError, connect, free_port
from grpo_stream.common.runtime.backoff import StopRequested
from grpo_stream.trainer_service.learning.collector import when_available
from tests.e2e.test_up import ROOT, run_cli
from tests.support import wait_for

pytestmark = pytest.mark.redis


def stop_soon(after_s: float = 0.5) -> threading.Event:
    stop = threading.Event()
    threading.Timer(after_s, stop.set).start()
    return stop


def test_the_buffer_retry_ends_at_a_stop_while_redis_is_down():
    server = EmbeddedRedis(appendonly=True, fsync="everysec").start()
    buffer = RedisStreamBuffer(connect(server.url, 5), "stop-test")
    buffer.set_held(0)
    server.kill()  # down, and nobody restarts it
    started = time.monotonic()
    try:
        with pytest.raises(StopRequested, match="auditing a checkpoint: Redis unavailable .* while stopping"):
            when_available("auditing a checkpoint", lambda: buffer.log_checkpoint("e", 1), stop_soon())
    finally:
        server.stop()
    assert time.monotonic() - started < 3.0  # not the back-off's 10 s steps, not for ever


def test_waiting_for_an_unreachable_redis_ends_at_a_stop():
    url = f"redis://127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    with pytest.raises(RedisConnectError, match="stopped while waiting for Redis"):
        connect(url, None, stop=stop_soon())  # None: it would wait for ever
    assert time.monotonic() - started < 3.0


def test_a_trainer_waiting_for_redis_stops_at_once_on_sigterm(tmp_path):
    """The trainer process itself: SIGTERM while it waits for a Redis that is not there ends it within seconds,
    with one line saying why, instead of a wait that only `up`'s kill after 120 s ended."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    tokens = run_cli("tokens", "--out", str(tmp_path / "auth"), timeout=60)
    assert tokens.returncode == 0, tokens.stderr
    proc = subprocess.Popen([sys.executable, "-m", "grpo_stream", "trainer", "--config",
                             "configs/tiny_arith_smoke.yaml",
                             "--run-dir", str(tmp_path / "r"), f"redis.url={url}",
                             f"auth.tokens_file={tmp_path / 'auth/tokens.yaml'}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: "(redis.url) not reachable" in "".join(lines), 120, "the trainer to wait for Redis")
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    text = "".join(lines)
    assert took < 5.0 and proc.returncode == 1, (took, text[-2000:])
    assert "stopped while waiting for Redis" in text, text[-2000:]
