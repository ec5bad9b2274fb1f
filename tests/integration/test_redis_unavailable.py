"""A Redis that cannot take writes for a while (full at maxmemory under noeviction, or a read-only replica) is
"unavailable, back off" for every caller, on a real redis-server: the buffer and the prompt queue raise
BufferUnavailable with nothing written, and the trainer's status writer keeps running and catches up once the
server takes writes again. Before one rule served every caller, these replies crashed the trainer (OOM) or
stopped its status thread for the rest of the run."""

import time

import pytest
import redis

from grpo_stream.common.rollouts.buffer import BufferUnavailable, Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, connect
from grpo_stream.trainer_service.ingest.prompt_queue import PromptQueue
from grpo_stream.trainer_service.ingest.prompt_service import StatusWriter

pytestmark = pytest.mark.redis


def group(i: int) -> Incoming:
    return Incoming(f"run/s0/{i}", "s0", 0, i, b"x" * 1000)


def wait_for(condition, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.02)


class CountingQueue(PromptQueue):
    """The prompt queue, counting the status writer's attempts (so the test waits on rounds, not on time)."""

    attempts = 0

    def write_status(self, status: dict) -> None:
        self.attempts += 1
        super().write_status(status)


class Samplers:
    @staticmethod
    def status(latest: int | None) -> list[dict]:
        return []


class Publisher:
    latest_version = 3
    samplers = Samplers()


def test_a_full_redis_is_unavailable_for_every_caller_and_nothing_is_written(redis_server):
    client = connect(redis_server.url, 5)
    buf, queue = RedisStreamBuffer(client, "full"), CountingQueue(client, "full")
    assert buf.append_many([group(0)], max_groups=100)[0][0] != "full"
    writer = StatusWriter(queue, Publisher(), total_steps=10, every_s=0.05).start()
    try:
        wait_for(lambda: queue.read_status().get("step") == 0, what="the first status record")
        entries = buf.read(10, block_ms=10)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)  # below what the server holds: every write is refused with OOM
        with pytest.raises(BufferUnavailable, match="redis"):
            buf.append_many([group(1), group(2)], max_groups=100)
        with pytest.raises(BufferUnavailable):
            queue.write_status({"step": -1})
        writer.step = 5
        tried = queue.attempts
        wait_for(lambda: queue.attempts >= tried + 3, what="three of the writer's rounds to meet the full server")
        assert writer._thread.is_alive()
        client.config_set("maxmemory", 0)
        wait_for(lambda: queue.read_status().get("step") == 5, what="the status writer to catch up")
        counters = buf.counters()
        assert counters["ingested"] == 1 and counters["trained"] == 0  # the refused calls wrote nothing
        assert buf.append_many([group(1)], max_groups=100)[0][0] != "full"
        assert buf.settle([(entries[0].entry_id, entries[0].group_id, "trained", 1)]) == 1
        assert buf.counters()["trained"] == 1
    finally:
        writer.stop()


def test_a_read_only_replica_is_unavailable_not_a_fault(redis_server):
    with EmbeddedRedis() as replica:
        client = connect(replica.url, 5)
        client.replicaof("127.0.0.1", redis_server.port)
        with pytest.raises(BufferUnavailable, match="(?i)read.only"):
            RedisStreamBuffer(client, "ro").append_many([group(0)], max_groups=10)
        with pytest.raises(BufferUnavailable):
            PromptQueue(client, "ro").write_status({"step": 1})
        client.replicaof("NO", "ONE")  # promoted (a failover done): writes go through again
        assert RedisStreamBuffer(client, "ro").append_many([group(0)], max_groups=10)[0][0] != "full"


def test_a_real_fault_still_propagates(redis_server):
    client = connect(redis_server.url, 5)
    client.set("grpo-stream:wrong:rollouts", "not a stream")  # a key of the wrong type: a bug, not an outage
    with pytest.raises(redis.ResponseError, match="DAMAGEDBUFFER grpo-stream:wrong:rollouts is a string, not the "):
        RedisStreamBuffer(client, "wrong").append_many([group(0)], max_groups=10)
