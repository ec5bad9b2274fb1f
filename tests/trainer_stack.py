"""A trainer's gRPC server on loopback (ingest and weight publication) over a real Redis, for the trainer server's
integration tests (test_trainer_server.py, test_trainer_server_weights.py): the `stack` fixture and small groups."""

import grpc
import numpy as np
import pytest

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.wire import CompletionData, GroupData, GroupLimits
from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer

LIMITS = GroupLimits(num_generations=2, max_prompt_tokens=8, max_new_tokens=6, vocab_size=50)


def group(i: int, sampler="sampler-0") -> GroupData:
    comps = [CompletionData(np.array([3, 4], np.int32), np.array([-0.5, -1.0], np.float32), float(j), False)
             for j in range(2)]
    # version 0: the ingest refuses a version ahead of every one a trainer published (none logged a step here)
    return GroupData(f"g{i}", f"p{i}", np.array([1, 2], np.int32), comps, 0, sampler, data_position=i)


@pytest.fixture
def stack(shared_redis, run_name):
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    ingest = IngestServicer(buffer, LIMITS, max_groups=4, retry_after_ms=20)
    publisher = WeightPublisher(chunk_bytes=100)
    server = TrainerServer(ingest, publisher, "127.0.0.1", 0)
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    try:
        yield buffer, ingest, publisher, server, channel
    finally:
        channel.close()
        server.stop(0)

