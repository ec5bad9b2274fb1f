"""wait_serving on a redis-server answering LOADING: waited for while its read position moves, given up on (with what
it had read) once it stops moving. A fake server: a real load that stalls cannot be made on demand."""

import pytest
import redis

from grpo_stream.common.rollouts import redis_server as redis_util


class _Process:
    pid = 4242

    def poll(self):
        return None  # alive throughout: only the stall can end the wait


class _LoadingServer:
    """Answers PING with LOADING; INFO's read position grows for `moves` INFO calls, then stays put."""

    def __init__(self, moves: int):
        self.moves, self.infos = moves, 0

    def ping(self):
        raise redis.BusyLoadingError("Redis is loading the dataset in memory")

    def info(self, section):
        self.infos += 1
        position = min(self.infos, self.moves) * 1000
        return {"loading": 1, "loading_loaded_bytes": position, "loading_loaded_perc": f"{position / 1000:g}"}

    def close(self):
        pass


def test_a_load_that_moves_is_waited_for_past_the_timeout_and_one_that_stalls_is_given_up_on(monkeypatch):
    server = _LoadingServer(moves=60)  # ~0.6s of moves at wait_serving's 10 ms polls: past timeout_s
    monkeypatch.setattr(redis.Redis, "from_url", lambda url, **options: server)
    monkeypatch.setattr(redis_util, "LOADING_STALL_S", 1.0, raising=False)
    with pytest.raises(redis_util.RedisConnectError) as exc:
        redis_util.wait_serving(_Process(), "redis://127.0.0.1:1/0", timeout_s=0.05)
    assert server.infos > server.moves  # it kept waiting while the load moved, and gave up only after
    assert "loading its data, 60% read, and read no more in 1s" in str(exc.value)


def test_a_stop_ends_the_wait_on_a_load_that_still_moves(monkeypatch):
    """`up` restarting its Redis mid-run waits for it on its main thread: a Ctrl-C then was acted on only once a
    large append-only file had loaded (the load is waited for while it moves: minutes)."""
    server = _LoadingServer(moves=10**9)  # moves for ever
    monkeypatch.setattr(redis.Redis, "from_url", lambda url, **options: server)
    with pytest.raises(redis_util.RedisConnectError, match="stopped while it started") as exc:
        redis_util.wait_serving(_Process(), "redis://127.0.0.1:1/0", timeout_s=0.05,
                                stopping=lambda: server.infos >= 20)
    assert server.infos == 20 and "loading its data" in str(exc.value)
