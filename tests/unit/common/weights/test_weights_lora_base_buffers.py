"""LoRA's frozen base is fetched once per trainer epoch: the fetcher's receive buffers, which it keeps to reuse
version after version, must not keep the base's. Wherever placing copies (an accelerator; on CPU a wire dtype cast
on the device, as here) they would hold a host copy of the base that nothing reads until the next epoch's base,
for a large model the host's whole share of it."""

import gc
from concurrent import futures

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS, SERVER_OPTIONS
from grpo_stream.common.weights.grpc_transport import GrpcFetcher, GrpcSink
from grpo_stream.protos import weights_pb2_grpc
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.publication.weight_service import WeightService

SHAPE = (64, 32)


@pytest.fixture
def served():
    """A publisher casting to bfloat16 on the wire, served over gRPC; a fetcher of it."""
    publisher = WeightPublisher(GrpcSink(1 << 16), "grpc", chunk_bytes=1 << 16, wire_dtype="bfloat16")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightService(publisher), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    fetcher = GrpcFetcher(channel, "sampler-0", streams=2, timeout_s=30)
    try:
        yield publisher, fetcher
    finally:
        fetcher.close()
        channel.close()
        server.stop(0)


def test_the_base_leaves_no_buffer_in_the_pool_and_versions_still_reuse_theirs(served):
    publisher, fetcher = served
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    target = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))}
    values = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE) / 8
    publisher.publish_base({"w": values})
    base = fetcher.fetch(publisher.held(-1).manifest(), target)
    np.testing.assert_array_equal(np.asarray(base["w"]), np.asarray(values.astype(jnp.bfloat16), np.float32))
    gc.collect()
    assert fetcher._buffers._arenas == {} and fetcher._buffers.allocated == 0
    publisher.publish_arrays(0, {"w": values + 1})
    for _ in range(3):  # a version's buffers are the pool's, reused (placing casts: none is held after it)
        got = fetcher.fetch(fetcher.latest(-1), target)
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray((values + 1).astype(jnp.bfloat16), np.float32))
    assert fetcher._buffers.allocated in (1, 2)
