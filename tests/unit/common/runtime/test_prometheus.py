"""A service's /metrics server (common/runtime/prometheus.py) against clients that connect and send nothing: each
held a server thread for ever (prometheus_client's start_http_server has no timeout and no bound), so anyone who could
reach the port grew the trainer's threads without limit."""

import select
import socket
import threading
import time
import urllib.request

import pytest

from grpo_stream.common.runtime import prometheus
from grpo_stream.common.runtime.prometheus import ServiceMetrics


def connection_threads() -> int:
    return sum("process_request" in t.name for t in threading.enumerate())


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    readable, _, _ = select.select([sock], [], [], within_s)
    return bool(readable) and sock.recv(1) == b""


def wait_closed(socks: list[socket.socket], count: int, within_s: float = 10.0) -> list[socket.socket]:
    """The sockets the server closed, once `count` of them are (or `within_s` passed)."""
    closed, deadline = [], time.monotonic() + within_s
    while len(closed) < count and time.monotonic() < deadline:
        readable, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.1)
        closed += [s for s in readable if s.recv(1) == b""]
    return closed


def scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read()


def test_idle_connections_past_the_bound_are_closed_and_hold_no_thread(monkeypatch):
    monkeypatch.setattr(prometheus, "MAX_CONNECTIONS", 4, raising=False)
    metrics = ServiceMetrics("test")
    metrics.gauge("up", "a figure").set(1)
    port = metrics.start("127.0.0.1", 0)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(12)]
    try:
        assert len(wait_closed(idle, 8)) == 8
        assert connection_threads() <= 4
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10  # the held ones see their clients hang up and free their places
    while connection_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert b"grpo_stream_up 1.0" in scrape(port)
    metrics.stop()


def test_a_connection_that_sends_no_request_is_closed_after_the_timeout(monkeypatch):
    monkeypatch.setattr(prometheus, "REQUEST_TIMEOUT_S", 0.2, raising=False)
    metrics = ServiceMetrics("test")
    metrics.gauge("up", "a figure").set(1)
    port = metrics.start("127.0.0.1", 0)
    try:
        with socket.create_connection(("127.0.0.1", port)) as silent:
            assert closed_by_server(silent, 5.0)
        assert b"grpo_stream_up 1.0" in scrape(port)
    finally:
        metrics.stop()


def test_a_metrics_port_in_use_names_the_setting_and_the_fix():
    """The bare "[Errno 98] Address already in use" named neither the port nor the setting."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=rf"trainer.metrics_port={port}: cannot serve metrics .* 0 for a free one"):
            ServiceMetrics("trainer").start("127.0.0.1", port, "trainer.metrics_port")
    finally:
        taken.close()
