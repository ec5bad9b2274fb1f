"""Weight versions changing hands while fetches run, on real gRPC servers and TCP data planes on loopback: host
buffers reused across versions on the trainer (a stalled fetch reads its version whole while the trainer publishes
on), receive buffers reused on the sampler (the installed version stays intact while sampling and while the next
ones arrive), and a fetch whose lanes ask around a publication (a late lane is served the version its sibling lanes
stream; a multi-host fetch asks every trainer process at once)."""

from __future__ import annotations

import threading
import time
import weakref

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from grpo_stream.common.model.sharding import make_mesh
from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS
from grpo_stream.common.weights import tcp_wire
from grpo_stream.common.weights.grpc_transport import GrpcFetcher, GrpcSink
from grpo_stream.common.weights.host_shards import add_sources
from grpo_stream.common.weights.host_staging import HostStaging
from grpo_stream.common.weights.snapshot import WeightSnapshot, box_to_proto
from grpo_stream.protos import weights_pb2, weights_pb2_grpc
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer
from tests.integration.test_multihost_weights import BOXES, FULL, publish
from tests.support import wait_for

BIG = (2048, 4096)  # 32 MB: more than a connection's windows and socket buffers hold, so a stalled fetch stays open


def _stack(publisher: WeightPublisher, tcp: bool, max_serve_mb_s: float | None = None):
    server = TrainerServer(None, publisher, "127.0.0.1", 0, data_port=0 if tcp else None,
                           max_serve_mb_s=max_serve_mb_s)
    port = server.start()
    return server, grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)


def _whole(shape) -> weights_pb2.TensorSlices:
    return weights_pb2.TensorSlices(tensor_index=0, slices=[box_to_proto(tuple(slice(0, n) for n in shape))])


def _stalled_fetch(channel, publisher, tcp: bool, version: int, data_port: int):
    """A fetch of tensor 0 of `version` that took its first bytes and reads no more: (read the rest, end it)."""
    request = weights_pb2.FetchSlicesRequest(sampler_id="slow", version=version, trainer_epoch=publisher.epoch,
                                             tensors=[_whole(BIG)])
    if not tcp:
        call = weights_pb2_grpc.WeightServiceStub(channel).FetchSlices(request)
        first = next(call)
        return (lambda: first.data + b"".join(c.data for c in call)), call.cancel
    import socket  # noqa: PLC0415 - this helper only

    sock = socket.create_connection(("127.0.0.1", data_port))
    sock.sendall(tcp_wire.encode_request(request.SerializeToString()))
    assert tcp_wire.read_status(sock, time.monotonic() + 30)[0] == 0

    def rest() -> bytes:
        out = np.empty(BIG, np.float32)
        tcp_wire.receive_slice(sock, 0, 0, out, "a", time.monotonic() + 30)
        return out.tobytes()
    return rest, sock.close


@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_a_stalled_fetch_reads_its_version_whole_while_the_trainer_publishes_on(plane):
    """Host buffers are reused across versions: a fetch that stalls on version 1 keeps its buffers out of that
    rotation, so versions 2..5 go to other buffers, and it reads version 1 whole when it resumes (its checksums
    are computed as the bytes go out, so only this rule keeps torn bytes away). One extra set of buffers at most."""
    staging = HostStaging(pooled=True)
    publisher = WeightPublisher(GrpcSink(1 << 20, staging), "grpc", chunk_bytes=1 << 20)
    server, channel = _stack(publisher, plane == "tcp")
    try:
        def params(v):
            return {"a": jnp.full(BIG, float(v), jnp.float32), "b": jnp.arange(7, dtype=jnp.float32) + v}
        publisher.publish_arrays(0, params(0))
        publisher.publish_arrays(1, params(1))
        rest, end = _stalled_fetch(channel, publisher, plane == "tcp", 1, publisher.data_port)
        made = {}  # every host buffer the staging made, weakly
        for v in range(2, 6):
            publisher.publish_arrays(v, params(v))
            np.testing.assert_array_equal(publisher.held(v).arrays["a"], float(v))
            made.update({id(a): weakref.ref(a) for arenas in staging.buffers._arenas.values() for a in arenas})
            alive = sum(ref() is not None for ref in made.values())
            assert alive <= 3 * 2, f"{alive} host buffers for 2 tensors: the two sets that take turns and version 1's"
        got = np.frombuffer(rest(), np.float32)
        assert got.size == BIG[0] * BIG[1] and np.all(got == 1.0), "the stalled fetch read bytes of a later version"
        end()
    finally:
        channel.close()
        server.stop(0)


def _place_targets(shapes: dict) -> dict:
    mesh = make_mesh(1, 1, jax.devices(), "sampler.mesh")
    return {n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
            for n, s in shapes.items()}


@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_the_installed_version_is_untouched_while_sampling_and_while_later_ones_arrive(plane):
    """Receive buffers are reused across versions and, on CPU, placed without a copy: the installed parameters are
    those buffers. Version 0 stays installed (a jitted step keeps reading it on another thread) while versions 1..4
    are received; it must keep its bytes, and the buffers must still be reused once nothing holds them."""
    shapes = {"w": (256, 128), "v": (64,)}
    publisher = WeightPublisher(chunk_bytes=1 << 12)
    server, channel = _stack(publisher, plane == "tcp")
    fetcher = GrpcFetcher(channel, "s0", streams=2, timeout_s=30, data_host="127.0.0.1" if plane == "tcp" else None)
    targets = _place_targets(shapes)

    def arrays(v):
        return {n: np.full(s, float(v), np.float32) for n, s in shapes.items()}

    step = jax.jit(lambda p: jnp.tanh(p["w"] @ p["w"].T).sum() + p["v"].sum())
    try:
        publisher.publish(WeightSnapshot(0, arrays(0)))
        held = {"installed": fetcher.fetch(fetcher.latest(-1), targets)}
        expected = float(step(held["installed"]))
        stop, sampled = threading.Event(), []

        def sample():  # the engine, generating with version 0 all along (at least once after the fetches)
            while True:
                sampled.append(float(step(held["installed"])))
                if stop.is_set():
                    return

        engine = threading.Thread(target=sample)
        engine.start()
        try:
            for v in range(1, 5):  # each received while version 0 and the one staged before it are held
                publisher.publish(WeightSnapshot(v, arrays(v)))
                held["staged"] = fetcher.fetch(fetcher.latest(-1), targets)
                np.testing.assert_array_equal(np.asarray(held["staged"]["w"]), float(v))
        finally:
            stop.set()
            engine.join()
        assert sampled and all(s == expected for s in sampled)
        for name, arr in held["installed"].items():
            np.testing.assert_array_equal(np.asarray(arr), 0.0, err_msg=f"installed {name} was overwritten")
        made = fetcher._buffers.allocated
        held.clear()
        for v in range(5, 8):  # nothing holds the old versions now: their buffers are taken again
            publisher.publish(WeightSnapshot(v, arrays(v)))
            fetcher.fetch(fetcher.latest(-1), targets)
        assert fetcher._buffers.allocated == made
    finally:
        fetcher.close()
        channel.close()
        server.stop(0)


@pytest.mark.parametrize("plane", ["grpc", "tcp"])
def test_a_lane_that_asks_after_the_switch_gets_the_version_its_sibling_lanes_stream(plane):
    """A fetch's lanes are requests of their own: one that asked after the trainer switched to the next version got
    NOT_FOUND while its sibling lanes still streamed the version, and the whole fetch failed. The replaced version
    is now served for as long as a fetch streams it, and no longer."""
    publisher = WeightPublisher(chunk_bytes=1 << 20)
    server, channel = _stack(publisher, plane == "tcp")
    fetcher = GrpcFetcher(channel, "s0", streams=2, timeout_s=30, data_host="127.0.0.1" if plane == "tcp" else None)
    targets = _place_targets({"a": BIG, "b": (32,)})

    def arrays(v):
        return {"a": np.full(BIG, float(v), np.float32), "b": np.full(32, float(v), np.float32)}

    try:
        publisher.publish(WeightSnapshot(0, arrays(0)))
        manifest = fetcher.latest(-1)
        rest, end = _stalled_fetch(channel, publisher, False, 0, 0)  # a lane that asked before the switch
        publisher.publish(WeightSnapshot(1, arrays(1)))
        got = fetcher.fetch(manifest, targets)  # its sibling lanes ask now
        for name, arr in got.items():
            np.testing.assert_array_equal(np.asarray(arr), 0.0, err_msg=name)
        assert np.all(np.frombuffer(rest(), np.float32) == 0.0)
        end()
        del got
        previous = publisher._previous  # the publisher's weak reference to version 0
        wait_for(lambda: previous() is None, 10, "version 0 to be let go once no fetch streams it")
        with pytest.raises(Exception, match="version 0 is not held"):
            fetcher.fetch(manifest, targets)
    finally:
        fetcher.close()
        channel.close()
        server.stop(0)


def test_a_multi_host_fetch_asks_every_trainer_process_at_once():
    """With more trainer processes than weights.fetch_streams, the lane of the second process waited for the first
    one's whole transfer, and asked for the version only then: a trainer publishing more often than that had
    replaced it (NOT_FOUND), at every retry. Every process's lane now asks at once."""
    publishers = [WeightPublisher(chunk_bytes=16, epoch="e1") for _ in range(2)]
    # process 0's transfer is slow (72 bytes at 36 B/s): the second lane used to queue behind it
    servers = [TrainerServer(None, p, "127.0.0.1", 0, max_serve_mb_s=mb) for p, mb in zip(publishers, (3.6e-5, None))]
    ports = [s.start() for s in servers]

    def gather(manifest):
        add_sources(manifest, dict(BOXES))
        manifest.ClearField("hosts")
        for port in ports:
            manifest.hosts.add(address="127.0.0.1", port=port)

    publishers[0].gather_hosts = gather
    planned = [threading.Event(), threading.Event()]
    for server, event in zip(servers, planned):  # the real plans, and when each process got its request
        def plan(request, real=server.slices.plan, event=event):
            event.set()
            return real(request)
        server.slices.plan = plan
    channel = grpc.insecure_channel(f"127.0.0.1:{ports[0]}", options=CHANNEL_OPTIONS)
    fetcher = GrpcFetcher(channel, "s0", streams=1, timeout_s=30)
    mesh = make_mesh(1, 1, jax.devices(), "sampler.mesh")
    targets = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, PartitionSpec()))
               for n, a in FULL.items()}
    try:
        publish(publishers, 1)
        manifest = fetcher.latest(-1)

        def trainer():  # publishes once both processes were asked, or a second into the first's transfer
            planned[0].wait(30)
            planned[1].wait(1.0)
            publish(publishers, 2, 2.0)

        publishing = threading.Thread(target=trainer)
        publishing.start()
        try:
            got = fetcher.fetch(manifest, targets)
        finally:
            publishing.join()
        for name, arr in FULL.items():
            np.testing.assert_array_equal(np.asarray(got[name]), arr)
    finally:
        fetcher.close()
        channel.close()
        for s in servers:
            s.stop(0)
