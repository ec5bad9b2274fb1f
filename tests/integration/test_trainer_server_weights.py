"""Weight publication on a real gRPC server on loopback, with a real Redis: fetched whole over gRPC streams or the
TCP data plane, bad requests refused, a restarted trainer followed, background fetches handed over whole."""

import threading
import time

import grpc
import numpy as np
import pytest

from grpo_stream.common.weights.snapshot import WeightSnapshot
from grpo_stream.sampler_service.weight_sync import WeightSync
from tests.support import FakeClock, wait_for
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from tests.trainer_stack import stack  # noqa: F401 (the fixture)


pytestmark = pytest.mark.redis


def _sync(channel, model, sampler_id="sampler-7", **kw):
    import jax

    from grpo_stream.common.model.sharding import make_mesh
    from grpo_stream.common.weights.grpc_transport import GrpcFetcher

    mesh = make_mesh(1, 1, jax.devices(), "sampler.mesh.tp")
    return WeightSync(GrpcFetcher(channel, sampler_id, streams=2, timeout_s=10), model, mesh, sampler_id,
                      channel=channel, **kw)


def test_weights_are_fetched_whole_and_history_is_recorded(stack, tiny_parts):
    _, _, publisher, _, channel = stack
    _, _, _, model = tiny_parts
    named = model.to_named_numpy()
    sync = _sync(channel, model)
    assert sync.poll() is None  # nothing published yet
    publisher.publish(WeightSnapshot(version=0, arrays=named))
    got = sync.poll()
    assert got.version == 0 and not got.final and got.nbytes == sum(a.nbytes for a in named.values())
    back = model.to_named_numpy(got.params)
    for k in named:
        np.testing.assert_array_equal(back[k], named[k])
    sync.mark_installed(got)
    assert sync.poll() is None  # up to date
    shifted = {k: v + 1 for k, v in named.items()}
    publisher.publish(WeightSnapshot(version=3, arrays=shifted, final=True))
    got = sync.poll()
    assert got.version == 3 and got.final
    np.testing.assert_array_equal(model.to_named_numpy(got.params)["embedder.input_embedding"],
                                  shifted["embedder.input_embedding"])
    sync.mark_installed(got)
    assert publisher.samplers.installed["sampler-7"] == [0, 3]
    assert publisher.samplers.samplers_at(3) == {"sampler-7": True}
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(WeightSnapshot(version=2, arrays=named))


def test_bad_slice_requests_get_invalid_argument_and_the_server_keeps_serving(stack, tiny_parts):
    from grpo_stream.protos import weights_pb2, weights_pb2_grpc

    _, _, publisher, _, channel = stack
    _, _, _, model = tiny_parts
    publisher.publish(WeightSnapshot(version=1, arrays=model.to_named_numpy()))
    stub = weights_pb2_grpc.WeightServiceStub(channel)
    bad = [weights_pb2.TensorSlices(tensor_index=999),
           weights_pb2.TensorSlices(tensor_index=0, slices=[weights_pb2.SliceRange(start=[0, 0], stop=[1, 10**6])]),
           weights_pb2.TensorSlices(tensor_index=0, slices=[weights_pb2.SliceRange(start=[0], stop=[1])])]
    for tensors in bad:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.FetchSlices(weights_pb2.FetchSlicesRequest(version=1, tensors=[tensors]), timeout=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FetchSlices(weights_pb2.FetchSlicesRequest(version=7), timeout=5))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "ask for the manifest again" in err.value.details()
    assert _sync(channel, model).poll().version == 1


def test_a_restarted_trainer_is_followed_and_failures_back_off(stack, tiny_parts):
    _, _, publisher, server, channel = stack
    _, _, _, model = tiny_parts
    named = model.to_named_numpy()
    clock = FakeClock()
    sync = _sync(channel, model, retry_initial_s=0.3, retry_max_s=0.6, max_staleness=2, clock=clock)
    publisher.publish(WeightSnapshot(version=5, arrays=named))
    sync.mark_installed(sync.poll())
    # a new trainer process (new epoch) starts again at version 0: the sampler follows it
    restarted = WeightPublisher(chunk_bytes=100)
    assert restarted.epoch != publisher.epoch
    publisher._switch(WeightSnapshot(0, {k: v * 2 for k, v in named.items()}, epoch=restarted.epoch).manifest(),
                      WeightSnapshot(0, {k: v * 2 for k, v in named.items()}, epoch=restarted.epoch))
    got = sync.poll()
    assert got is not None and got.version == 0 and got.epoch == restarted.epoch
    sync.mark_installed(got)
    # the trainer goes away: the fetch fails, the version stays, the next attempt waits for the back-off, a
    # jittered wait within [d/2, d] of the step d
    server.stop(0)
    assert sync.poll() is None and sync.failures == 1 and sync.installed_version == 0
    clock.advance(0.14)
    assert sync.poll() is None and sync.failures == 1  # inside the back-off: no new attempt
    clock.advance(0.17)
    assert sync.poll() is None and sync.failures == 2
    clock.advance(0.29)  # the step doubles, up to retry_max_s
    assert sync.poll() is None and sync.failures == 2
    clock.advance(0.32)
    assert sync.poll() is None and sync.failures == 3
    sync.latest_seen = 3
    assert sync.lag() == 3 and sync.too_stale()


def test_background_fetch_keeps_the_installed_version_until_the_new_one_is_whole(stack, tiny_parts):
    _, _, publisher, server, channel = stack
    _, _, _, model = tiny_parts
    named = model.to_named_numpy()
    nbytes = sum(a.nbytes for a in named.values())
    sync = _sync(channel, model, background=True)
    publisher.publish(WeightSnapshot(version=0, arrays=named))
    sync.mark_installed(wait_for(sync.poll, 30, "version 0 fetched in the background", interval_s=0.01))
    # serve slowly (about 1.5 s per version): polls return at once while the transfer runs
    server.slices.max_serve_mb_s = nbytes / 1.5 / 1e6
    publisher.publish(WeightSnapshot(version=1, arrays={k: v + 1 for k, v in named.items()}))
    start, polls = time.monotonic(), 0
    while (got := sync.poll()) is None:
        assert sync.installed_version == 0
        assert time.monotonic() - start < 60, "version 1 never arrived"
        polls += 1
        time.sleep(0.01)
    waited = time.monotonic() - start
    # polls came back empty while the paced transfer ran (a blocking fetch would return the version from its first
    # poll, with no empty one before it); the count does not depend on how fast this machine runs the loop
    assert got.version == 1 and waited > 0.5 and polls >= 2, (waited, polls)
    np.testing.assert_array_equal(model.to_named_numpy(got.params)["embedder.input_embedding"],
                                  named["embedder.input_embedding"] + 1)
    sync.close()


def test_tcp_data_plane_moves_versions_exactly_and_refuses_bad_requests(stack, tiny_parts):
    import socket

    import jax

    from grpo_stream.common.weights import tcp_wire as weight_bulk
    from grpo_stream.common.model.sharding import make_mesh
    from grpo_stream.protos import weights_pb2
    from grpo_stream.common.weights.grpc_transport import GrpcFetcher
    from grpo_stream.trainer_service.publication.grpc_transport_server.data_plane import WeightDataServer

    _, _, publisher, _, channel = stack
    _, _, _, model = tiny_parts
    named = model.to_named_numpy()
    data = WeightDataServer(publisher, "127.0.0.1", 0)
    port = data.start()
    try:
        fetcher = GrpcFetcher(channel, "sampler-3", streams=2, timeout_s=10, data_host="127.0.0.1")
        mesh = make_mesh(1, 1, jax.devices(), "sampler.mesh.tp")
        sync = WeightSync(fetcher, model, mesh, "sampler-3", channel=channel)
        for version, wire in ((1, "float32"), (2, "bfloat16")):
            publisher.wire_dtype = wire
            stats = publisher.publish_arrays(version, {k: jax.numpy.asarray(v) * version for k, v in named.items()})
            got = sync.poll()
            assert got.version == version and data.served_bytes > 0
            sync.mark_installed(got)
            expected = {k: np.asarray(jax.numpy.asarray(v * version).astype(wire).astype(np.float32))
                        for k, v in named.items()}
            for k, arr in model.to_named_numpy(got.params).items():
                np.testing.assert_array_equal(arr, expected[k])
        assert stats.nbytes * 2 == sum(a.nbytes for a in named.values())  # bf16 on the wire
        assert data.served_bytes == sum(a.nbytes for a in named.values()) * 3 // 2

        def ask(payload: bytes) -> tuple[int, str]:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(payload)
                return weight_bulk.read_status(sock, time.monotonic() + 5)

        code, message = ask(b"HTTP/1.1 GET /\r\n\r\n")
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "bad magic" in message
        code, message = ask(weight_bulk.encode_request(weights_pb2.FetchSlicesRequest(version=1).SerializeToString()))
        assert code == grpc.StatusCode.NOT_FOUND.value[0] and "ask for the manifest again" in message
        bad = weights_pb2.FetchSlicesRequest(version=2, tensors=[weights_pb2.TensorSlices(tensor_index=999)])
        code, message = ask(weight_bulk.encode_request(bad.SerializeToString()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "tensor_index=999" in message
        whole = weights_pb2.SliceRange(start=[0, 0], stop=list(named["embedder.input_embedding"].shape))
        index = list(named).index("embedder.input_embedding")
        repeated = weights_pb2.FetchSlicesRequest(version=2, tensors=[
            weights_pb2.TensorSlices(tensor_index=index, slices=[whole] * 1000)])
        code, message = ask(weight_bulk.encode_request(repeated.SerializeToString()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "ask for each slice once" in message
        # still serving after the bad requests
        publisher.publish_arrays(3, {k: jax.numpy.asarray(v) for k, v in named.items()})
        assert sync.poll().version == 3
    finally:
        data.stop()


def test_unreachable_data_plane_falls_back_to_grpc_streams(stack, tiny_parts, caplog, monkeypatch):
    import socket

    import jax

    from grpo_stream.common.rollouts.redis_server import free_port
    from grpo_stream.common.model.sharding import make_mesh
    from grpo_stream.common.weights.grpc_transport import GrpcFetcher

    _, _, publisher, _, channel = stack
    _, _, _, model = tiny_parts
    named = model.to_named_numpy()
    publisher.data_port = free_port()  # announced, but nothing listens there
    publisher.publish(WeightSnapshot(version=4, arrays=named))
    fetcher = GrpcFetcher(channel, "sampler-5", streams=2, timeout_s=10, data_host="127.0.0.1")
    sync = WeightSync(fetcher, model, make_mesh(1, 1, jax.devices(), "sampler.mesh.tp"), "sampler-5")
    with caplog.at_level("WARNING"):
        got = sync.poll()
    assert got is not None and got.version == 4 and "fetching over gRPC instead" in caplog.text
    for k, arr in model.to_named_numpy(got.params).items():
        np.testing.assert_array_equal(arr, named[k])
    # the next version goes over gRPC at once: the unreachable plane (up to 15 s a lane) is not tried again
    sync.mark_installed(got)
    tried = []
    real = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: tried.append(a) or real(*a, **k))
    publisher.publish(WeightSnapshot(version=5, arrays=named))
    assert sync.poll().version == 5 and tried == []


def test_busy_data_plane_sends_fetches_over_grpc(stack, tiny_parts):
    import socket

    import jax

    from grpo_stream.common.model.sharding import make_mesh
    from grpo_stream.common.weights.grpc_transport import GrpcFetcher
    from grpo_stream.trainer_service.publication.grpc_transport_server.data_plane import WeightDataServer

    from grpo_stream.common.weights import tcp_wire
    from grpo_stream.protos import weights_pb2

    _, _, publisher, server, channel = stack
    _, _, _, model = tiny_parts
    named = model.to_named_numpy()
    release = threading.Event()

    class Held:  # the publisher's slices, whose transfers wait at their first piece until released
        plan = staticmethod(server.slices.plan)

        @staticmethod
        def pace(sent, start):
            release.wait(30)

    data = WeightDataServer(publisher, "127.0.0.1", 0, workers=1, slices=Held())
    port = data.start()
    publisher.data_port = port
    try:
        publisher.publish(WeightSnapshot(version=6, arrays=named))
        holder = socket.create_connection(("127.0.0.1", port))  # asks for a slice and takes the only slot
        shape = list(publisher._manifest.tensors[0].shape)
        holder.sendall(tcp_wire.encode_request(weights_pb2.FetchSlicesRequest(version=6, tensors=[
            weights_pb2.TensorSlices(tensor_index=0, slices=[weights_pb2.SliceRange(start=[0] * len(shape),
                                                                                    stop=shape)])]
        ).SerializeToString()))
        wait_for(lambda: data.active_transfers == 1, 30, "the data plane to give its only slot to the first request")
        fetcher = GrpcFetcher(channel, "sampler-6", streams=2, timeout_s=10, data_host="127.0.0.1")
        sync = WeightSync(fetcher, model, make_mesh(1, 1, jax.devices(), "sampler.mesh.tp"), "sampler-6")
        got = sync.poll()
        assert got is not None and got.version == 6 and data.served_bytes == 0
        for k, arr in model.to_named_numpy(got.params).items():
            np.testing.assert_array_equal(arr, named[k])
        holder.close()
    finally:
        release.set()
        data.stop()
