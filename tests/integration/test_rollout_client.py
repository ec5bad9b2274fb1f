"""The sampler's rollout stream survives an ingest restart without losing or duplicating groups."""

import grpc
import numpy as np
import pytest

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS
from grpo_stream.common.rollouts.redis_server import connect, free_port
from grpo_stream.common.rollouts.wire import decode_group, to_proto
from grpo_stream.sampler_service.rollout_client import RolloutClient
from tests.integration.test_trainer_server import LIMITS, group
from tests.support import wait_for
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer

pytestmark = pytest.mark.redis


def start_server(buffer, port):
    server = TrainerServer(IngestServicer(buffer, LIMITS, max_groups=100, retry_after_ms=20), WeightPublisher(),
                           "127.0.0.1", port)
    server.start()
    return server


def test_groups_survive_an_ingest_restart(shared_redis, run_name):
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    port = free_port()
    server = start_server(buffer, port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    client = RolloutClient(channel, backlog_max_groups=16).start()
    try:
        for i in range(3):
            assert client.put(to_proto(group(i)), timeout_s=5)
        assert client.drain(10)
        server.stop(0)
        # produced while the ingest is down: held by the client
        for i in range(3, 8):
            assert client.put(to_proto(group(i)), timeout_s=5)
        # the sender notices a dead stream only when it sends: a reconnect means it tried these groups and failed
        wait_for(lambda: client.stats["reconnects"] >= 1, 30, "the client to try the stopped ingest")
        assert client.unacked == 5
        server = start_server(buffer, port)
        assert client.drain(30), f"{client.unacked} groups never acknowledged"
        ids = [decode_group(e.payload).group_id for e in buffer.read(100, 100)]
        assert ids == [f"g{i}" for i in range(8)]
        assert client.stats["reconnects"] >= 1
    finally:
        client.close()
        channel.close()
        server.stop(0)


def test_groups_too_stale_to_train_are_not_sent(shared_redis, run_name):
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    port = free_port()
    server = start_server(buffer, port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    client = RolloutClient(channel, backlog_max_groups=16)
    buffer.log_step("epoch", 4, [])  # the trainer logged step 4: it published versions 0..4 (the ingest checks)
    try:
        for i in range(6):  # group i was made with weight version i
            group_i = to_proto(group(i))
            group_i.policy_version = i
            assert client.put(group_i, timeout_s=5)
        client.min_version = 3  # the sampler installed a version after which 0..2 exceed the staleness bound
        client.start()
        assert client.drain(10)
        assert [decode_group(e.payload).policy_version for e in buffer.read(100, 100)] == [3, 4, 5]
        assert client.stats["dropped_stale"] == 3 and client.stats["accepted"] == 3 and client.unacked == 0
    finally:
        client.close()
        channel.close()
        server.stop(0)


def test_a_training_group_the_ingest_refuses_is_told_back_with_its_starting_version(shared_redis, run_name):
    """A group the ingest refuses as invalid never reaches the trainer. It was counted toward
    sampler.max_groups_per_version all the same, so a synchronous sampler (one step's groups per version) waited for a
    version the trainer, one group short of its step, never made: `lost` is told its starting version. An
    evaluation-only answer never counted toward the cap, so it is not told."""
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    port = free_port()
    server = start_server(buffer, port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    client = RolloutClient(channel, backlog_max_groups=16)
    lost = []
    client.lost = lost.append
    try:
        bad = to_proto(group(1))
        bad.completions[0].token_ids_le = np.array([3, 99], "<i4").tobytes()  # past the vocabulary of 50
        evaluation = to_proto(group(2))
        evaluation.completions[0].token_ids_le = np.array([3, 99], "<i4").tobytes()
        assert client.put(to_proto(group(0)), timeout_s=5, started_at=4)
        assert client.put(bad, timeout_s=5, started_at=4)
        assert client.put(evaluation, timeout_s=5, evaluation_only=True, started_at=4)
        client.start()
        assert client.drain(10)
        assert client.stats["rejected_invalid"] == 2 and client.stats["accepted"] == 1
        assert lost == [4]
    finally:
        client.close()
        channel.close()
        server.stop(0)
