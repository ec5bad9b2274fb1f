"""The Redis-streams buffer against a real redis-server."""

import pytest

from common.buffer import BufferFull, BufferUnavailable, InMemoryBuffer, RedisStreamBuffer
from common.redis_util import RedisConnectError, connect

pytestmark = pytest.mark.redis


def make_buffers(redis_server):
    return [RedisStreamBuffer(connect(redis_server.url, 5), "t"), InMemoryBuffer()]


def identity_holds(c):
    return c["ingested"] == (c["trained"] + c["dropped_stale"] + c["dropped_invalid"] + c["dropped_filtered"]
                             + c["depth"])


@pytest.mark.parametrize("kind", [0, 1], ids=["redis", "memory"])
def test_append_read_settle_keeps_the_accounting_identity(redis_server, kind):
    buf = make_buffers(redis_server)[kind]
    for i in range(5):
        assert buf.append(f"g{i}".encode(), f"s{i % 2}", max_groups=10) == i + 1
    first = buf.read(3, block_ms=100)
    assert [e.payload for e in first] == [b"g0", b"g1", b"g2"]
    # delivered entries are not delivered again, but still count as in the buffer
    assert [e.payload for e in buf.read(10, block_ms=100)] == [b"g3", b"g4"]
    assert buf.depth() == 5 and identity_holds(buf.counters())
    buf.settle([first[0].entry_id], [first[2].entry_id], dropped_filtered=[first[1].entry_id])
    c = buf.counters()
    assert (c["ingested"], c["trained"], c["dropped_stale"], c["dropped_filtered"], c["depth"]) == (5, 1, 1, 1, 2)
    assert identity_holds(c)
    assert buf.ingested_by_sampler() == {"s0": 3, "s1": 2}
    assert buf.read(5, block_ms=50) == []


@pytest.mark.parametrize("kind", [0, 1], ids=["redis", "memory"])
def test_full_buffer_refuses_without_writing(redis_server, kind):
    buf = make_buffers(redis_server)[kind]
    buf.append(b"a", "s", max_groups=2)
    buf.append(b"b", "s", max_groups=2)
    with pytest.raises(BufferFull, match="buffer.max_groups=2"):
        buf.append(b"c", "s", max_groups=2)
    assert buf.counters()["ingested"] == 2 and buf.depth() == 2


def test_runs_are_namespaced(redis_server):
    client = connect(redis_server.url, 5)
    a, b = RedisStreamBuffer(client, "run-a"), RedisStreamBuffer(client, "run-b")
    a.append(b"x", "s", 10)
    assert b.depth() == 0 and b.read(10, 50) == []


def test_unreachable_redis_is_reported(redis_server):
    buf = RedisStreamBuffer(connect(redis_server.url, 5), "t")
    redis_server.stop()
    with pytest.raises(BufferUnavailable):
        buf.append(b"x", "s", 10)


def test_connect_gives_up_with_a_clear_message():
    from common.redis_util import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisConnectError, match=r"redis.url=redis://127.0.0.1:\d+/0: not reachable after"):
        connect(url, timeout_s=0.5)
    with pytest.raises(RedisConnectError, match="not a redis:// URL"):
        connect("http://x", 0.5)


def test_a_restarted_trainer_takes_back_what_its_predecessor_read_but_never_settled(redis_server):
    first = RedisStreamBuffer(connect(redis_server.url, 5), "restart")
    for i in range(6):
        first.append(f"g{i}".encode(), "s0", max_groups=6)
    taken = first.read(4, block_ms=100)
    first.settle(trained=[taken[0].entry_id])
    # the trainer process dies holding g1..g3: a new one (same consumer) gets them first, each once, then the rest
    second = RedisStreamBuffer(connect(redis_server.url, 5), "restart")
    got = [e.payload for e in second.read(2, block_ms=100)] + [e.payload for e in second.read(2, block_ms=100)]
    got += [e.payload for e in second.read(10, block_ms=100)]
    assert got == [b"g1", b"g2", b"g3", b"g4", b"g5"]
    assert second.read(10, block_ms=50) == []
    second.settle(trained=[])
    assert second.depth() == 5 and identity_holds(second.counters())
