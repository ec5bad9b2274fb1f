"""The start-up check of a Redis the services are pointed at (redis.url): settings that can lose acknowledged
groups are refused by the trainer's buffer, the standalone ingest and `up`, naming the setting and the override;
against real redis-servers configured each way."""

import logging

import pytest

from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, RedisConnectError, connect
from grpo_stream.common.rollouts.registry import open_buffer
from grpo_stream.trainer_service.ingest.server import run_ingest
from tests.support import with_run_name

pytestmark = pytest.mark.redis


def redis_cfg(cfg, url: str, allow: bool = False):
    redis = cfg.redis.model_copy(update={"url": url, "allow_unsafe_persistence": allow})
    return cfg.model_copy(update={"redis": redis})


@pytest.fixture(scope="module")
def unsafe():
    with EmbeddedRedis() as server:  # no append-only file
        yield server


def test_a_redis_without_an_append_only_file_is_refused_unless_allowed(small_cfg, unsafe, caplog, run_name):
    cfg = with_run_name(redis_cfg(small_cfg, unsafe.url), run_name)
    with pytest.raises(RedisConnectError, match="appendonly no.*redis.allow_unsafe_persistence=true") as err:
        open_buffer(cfg)
    assert "trainer refuses" in str(err.value)
    with pytest.raises(RedisConnectError, match="ingest refuses.*appendonly"):
        run_ingest(cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"mode": "none"})}))
    with caplog.at_level(logging.WARNING):
        buffer = open_buffer(redis_cfg(cfg, unsafe.url, allow=True))
    assert buffer.counters()["ingested"] == 0
    assert "can lose acknowledged groups" in caplog.text and "appendonly" in caplog.text


@pytest.mark.parametrize("setting, value, named", [("maxmemory-policy", "allkeys-lru", "maxmemory-policy allkeys-lru"),
                                                   ("appendfsync", "no", "appendfsync no")])
def test_eviction_and_unsynced_writes_are_refused(small_cfg, redis_server, run_name, setting, value, named):
    cfg = with_run_name(redis_cfg(small_cfg, redis_server.url), run_name)
    open_buffer(cfg)  # the fixture's server: append-only file, fsync every second, no eviction
    connect(redis_server.url, 5).config_set(setting, value)
    with pytest.raises(RedisConnectError, match=named):
        open_buffer(cfg)


def test_up_stops_before_starting_anything_on_an_unsafe_redis(small_cfg, unsafe, tmp_path, capsys):
    from grpo_stream.up.run import run_up  # noqa: PLC0415

    code = run_up(None, [], redis_cfg(small_cfg, unsafe.url), tmp_path / "run")
    assert code == 1 and "appendonly" in capsys.readouterr().err
    assert not (tmp_path / "run" / "logs").exists() or not any((tmp_path / "run" / "logs").iterdir())
