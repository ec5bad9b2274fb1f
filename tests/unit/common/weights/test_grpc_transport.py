"""The grpc transport end to end on 2 fake CPU devices (a subprocess, so the device count can be set): a trainer
whose parameters are sharded one way publishes through reused host buffers (copied through pinned host memory in
half of the cases), a sampler whose mesh shards them another way receives each box into a reused aligned buffer and
places it with the target sharding. Over the TCP data plane and over FetchSlices streams, in the model's dtype and
cast from bfloat16 on the wire, the placed arrays equal the sent ones shard by shard, and on CPU the received
buffers become the parameters without a copy."""

import os
import pathlib
import re
import subprocess
import sys

SCRIPT = r'''
from concurrent import futures

import grpc
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS, SERVER_OPTIONS
from grpo_stream.common.weights.grpc_transport import GrpcFetcher, GrpcSink
from grpo_stream.common.weights.host_staging import HostStaging
from grpo_stream.protos import weights_pb2_grpc
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.publication.grpc_transport_server.data_plane import WeightDataServer
from grpo_stream.trainer_service.publication.weight_service import WeightService

assert jax.device_count() == 2
mesh = Mesh(np.array(jax.devices()), ("tp",))
shapes = {"w": (16, 12), "v": (10,), "s": ()}
trainer = {"w": P(None, "tp"), "v": P("tp"), "s": P()}  # columns split: the sampler needs rows of both devices
sampler = {"w": P("tp", None), "v": P(), "s": P()}
targets = {n: jax.ShapeDtypeStruct(shapes[n], jnp.float32, sharding=NamedSharding(mesh, sampler[n])) for n in shapes}


def params(version):
    out = {}
    for n, shape in shapes.items():
        values = jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape) / 3 + version
        out[n] = jax.device_put(values, NamedSharding(mesh, trainer[n]))
    return out


for plane in ("tcp", "grpc"):
    for wire in ("model", "bfloat16"):
        staging = HostStaging(pooled=True, pinned=plane == "grpc")  # pinned: an accelerator's path, on CPU memory
        publisher = WeightPublisher(GrpcSink(1 << 16, staging), "grpc", chunk_bytes=1 << 16, wire_dtype=wire)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
        weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightService(publisher), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        data = WeightDataServer(publisher, "127.0.0.1", 0) if plane == "tcp" else None
        if data is not None:
            data.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        fetcher = GrpcFetcher(channel, "sampler-0", streams=2, timeout_s=30,
                              data_host="127.0.0.1" if data is not None else None)
        installed, boxes = None, None
        for version in range(5):
            sent = params(version)
            publisher.publish_arrays(version, sent)
            got = fetcher.fetch(fetcher.latest(-1), targets)
            for n, arr in got.items():
                expected = np.asarray(sent[n].astype(jnp.bfloat16).astype(jnp.float32) if wire != "model" else sent[n])
                assert arr.sharding == targets[n].sharding and arr.dtype == jnp.float32, (n, arr.sharding)
                np.testing.assert_array_equal(np.asarray(arr), expected)
                for shard in arr.addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
            boxes = fetcher._buffers.allocated if boxes is None else boxes
            if wire == "model":  # the installed arrays are the receive buffers themselves
                for shard in got["w"].addressable_shards:
                    assert any(np.shares_memory(np.asarray(shard.data), a) for arenas in
                               fetcher._buffers._arenas.values() for a in arenas), "w was copied when placed"
            installed = got  # the sampler runs this version until the next one is in
        # two sets at most: the installed version's and the one being received (one when placing casts on device)
        assert fetcher._buffers.allocated <= 2 * boxes, (fetcher._buffers.allocated, boxes)
        assert staging.buffers.allocated == 2 * len(shapes), staging.buffers.allocated
        assert staging.pinned is (plane == "grpc")  # no fall-back from the pinned copies
        channel.close()
        server.stop(0)
        if data is not None:
            assert data.served_bytes > 0
            data.stop()
print("ok")
'''


def test_placed_arrays_equal_the_sent_ones_with_the_sampler_sharding_on_two_devices():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    root = pathlib.Path(__file__).resolve().parents[4]
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_an_ipv6_trainer_process_is_a_target_grpc_reaches():
    """A multi-host trainer's process advertised by a bare IPv6 pod IP was dialled as `fd00::1:50151`, which names
    no host: its slices could never be fetched. Bracketed, a real channel reaches a server on ::1."""
    from concurrent import futures  # noqa: PLC0415

    import grpc  # noqa: PLC0415
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: PLC0415

    from grpo_stream.common.weights.grpc_transport import grpc_target  # noqa: PLC0415

    assert grpc_target("10.0.0.7", 50151) == "10.0.0.7:50151" and grpc_target("trainer-1", 1) == "trainer-1:1"
    assert grpc_target("fd00::1", 50151) == "[fd00::1]:50151" and grpc_target("[::1]", 5) == "[::1]:5"
    server = grpc.server(futures.ThreadPoolExecutor(1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("[::1]:0")
    server.start()
    try:
        with grpc.insecure_channel(grpc_target("::1", port)) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(None)


def test_a_manifest_dtype_the_sampler_cannot_cast_is_refused_naming_the_field_before_any_byte_moves():
    import grpc
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest

    from grpo_stream.common.weights.grpc_transport import GrpcFetcher
    from grpo_stream.common.weights.snapshot import WeightSnapshot
    from grpo_stream.common.weights.transport import WeightsMismatch

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32, sharding=sharding)}
    channel = grpc.insecure_channel("127.0.0.1:1")  # never called: the manifest is refused first
    fetcher = GrpcFetcher(channel, "sampler-0", streams=1, timeout_s=5)
    try:
        for dtype in ("object", "<U1", "complex64", "no-such-dtype", "(100000000000,)f4"):
            manifest = WeightSnapshot(1, {"w": np.zeros((3, 4), np.float32)}).manifest()
            manifest.tensors[0].dtype = dtype
            with pytest.raises(WeightsMismatch, match=rf"tensors\[0\].dtype='{re.escape(dtype)}' \(w\) is not a float"):
                fetcher.fetch(manifest, targets)
        assert fetcher._buffers.allocated == 0
    finally:
        fetcher.close()
        channel.close()
