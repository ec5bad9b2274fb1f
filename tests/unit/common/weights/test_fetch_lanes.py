"""A weight fetch whose lane fails ends its other lanes before it returns (common/weights/fetch_lanes.py).

They used to keep receiving in the fetcher's pool until their own deadlines: the next attempt's lanes queued behind
them, started late and ran past that attempt's wait, so one failure made several (a healthy fetch after two failed
ones timed out). Here the real WeightService on loopback, with a fault injected, fails one lane of a fetch and holds
the other until its call ends; the fetcher counts its lanes running, at each fetch's start and after a failure."""

import socket
import threading
from concurrent import futures

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS, SERVER_OPTIONS
from grpo_stream.common.weights import tcp_wire
from grpo_stream.common.weights.fetch_lanes import FetchCancelled
from grpo_stream.common.weights.grpc_transport import GrpcFetcher, GrpcSink
from grpo_stream.common.weights.snapshot import WeightTransferError
from grpo_stream.protos import weights_pb2, weights_pb2_grpc
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.publication.weight_service import WeightService
from tests.support import wait_for

TIMEOUT_S = 20  # a lane held past this fails the test's assertions anyway (it is what the unfixed fetch waited)


class FaultyService(WeightService):
    """The weight service; while `failing` names a tensor, a FetchSlices asking for it is refused (UNAVAILABLE) and
    any other is held until its call ends (cancelled by the client, or its deadline)."""

    def __init__(self, publisher):
        super().__init__(publisher)
        self.failing: int | None = None

    def FetchSlices(self, request, context):
        if self.failing is None:
            yield from super().FetchSlices(request, context)
            return
        if any(t.tensor_index == self.failing for t in request.tensors):
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected: this lane fails")
        ended = threading.Event()
        context.add_callback(ended.set)
        ended.wait()


class CountingFetcher(GrpcFetcher):
    """Counts its lanes running (entered and not returned) and, when each fetch starts, those still running."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.running, self.at_fetch_start, self._count = 0, [], threading.Lock()

    def fetch(self, manifest, targets):
        self.at_fetch_start.append(self.running)
        return super().fetch(manifest, targets)

    def _counted(self, lane, *args, **kwargs):
        with self._count:
            self.running += 1
        try:
            return lane(*args, **kwargs)
        finally:
            with self._count:
                self.running -= 1

    def _stream(self, *args, **kwargs):
        return self._counted(super()._stream, *args, **kwargs)

    def _stream_tcp(self, *args, **kwargs):
        return self._counted(super()._stream_tcp, *args, **kwargs)


@pytest.fixture
def served():
    """Two tensors (so two lanes: the larger is the first) served by a FaultyService; a targets dict on one device."""
    publisher = WeightPublisher(GrpcSink(1 << 16), "grpc", chunk_bytes=1 << 16)
    service = FaultyService(publisher)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=SERVER_OPTIONS)
    weights_pb2_grpc.add_WeightServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",)),
                                          jax.sharding.PartitionSpec())
    sent = {"big": jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64), "small": jnp.arange(8, dtype=jnp.float32)}
    targets = {n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for n, a in sent.items()}
    publisher.publish_arrays(0, sent)
    try:
        yield service, channel, sent, targets
    finally:
        channel.close()
        server.stop(0)


@pytest.mark.parametrize("failing", ["big", "small"])  # the first lane fails, or the second while the first is held
def test_a_failed_fetch_ends_its_other_lanes_and_the_next_starts_on_a_free_pool(served, failing):
    service, channel, sent, targets = served
    fetcher = CountingFetcher(channel, "sampler-0", streams=2, timeout_s=TIMEOUT_S)
    try:
        manifest = fetcher.latest(-1)
        service.failing = [t.name for t in manifest.tensors].index(failing)
        with pytest.raises(grpc.RpcError) as failed:
            fetcher.fetch(manifest, targets)
        # the failing lane's error, at once: not the held lane's deadline after waiting for it in lane order
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert fetcher.running == 0  # the held lane's call was cancelled, and the fetch returned once it ended
        service.failing = None
        for _ in range(2):
            got = fetcher.fetch(fetcher.latest(-1), targets)
            for name, values in sent.items():
                np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(values))
        assert fetcher.at_fetch_start == [0, 0, 0]  # no lane of an earlier fetch ahead of any fetch's own
    finally:
        fetcher.close()


class SilentDataPlane:
    """A TCP data plane on loopback that refuses (UNAVAILABLE) a request for tensor `failing` and answers nothing to
    any other, until the client shuts or closes its end."""

    def __init__(self, failing: int, stall_after_status: bool = False):
        self.failing, self.stall_after_status, self.stalled = failing, stall_after_status, 0
        self.conns: list[socket.socket] = []  # shut by stop(): a lane still reading from one ends
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:  # closed by stop()
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            reader = tcp_wire.RequestReader()
            while reader.wanted:
                reader.feed(conn.recv(reader.wanted))
            request = weights_pb2.FetchSlicesRequest.FromString(reader.request)
            if any(t.tensor_index == self.failing for t in request.tensors):
                conn.sendall(tcp_wire.encode_status(grpc.StatusCode.UNAVAILABLE.value[0], "injected"))
                return
            if self.stall_after_status:  # the transfer starts, and stops (a trainer stalled, a link cut)
                conn.sendall(tcp_wire.encode_status(0))
                self.stalled += 1
            while conn.recv(1 << 16):  # silent until the client shuts or closes its end
                pass

    def stop(self):
        self.listener.close()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass


def test_a_data_plane_lane_is_shut_when_another_lane_of_its_fetch_fails(served):
    service, channel, _, targets = served
    fetcher = CountingFetcher(channel, "sampler-0", streams=2, timeout_s=TIMEOUT_S, data_host="127.0.0.1")
    manifest = fetcher.latest(-1)
    plane = SilentDataPlane(failing=[t.name for t in manifest.tensors].index("big"))
    manifest.data_port = plane.port
    try:
        with pytest.raises(WeightTransferError, match="UNAVAILABLE: injected"):
            fetcher.fetch(manifest, targets)
        # the silent lane's socket was shut, and it made no fall-back call over gRPC: the fetch is over
        assert fetcher.running == 0
    finally:
        plane.stop()
        fetcher.close()


def test_closing_the_fetcher_ends_a_data_plane_fetch_in_flight(served):
    """A sampler stopped mid-fetch closes its fetcher. Data-plane lanes are raw sockets, which closing the gRPC
    channel does not end, in pool threads the interpreter joins at exit: the stopped sampler lived on until the
    fetch's deadline (sampler.rpc_timeout_s, up to an hour)."""
    _, channel, _, targets = served
    fetcher = GrpcFetcher(channel, "sampler-0", streams=2, timeout_s=600, data_host="127.0.0.1")
    manifest = fetcher.latest(-1)
    plane = SilentDataPlane(failing=-1, stall_after_status=True)
    manifest.data_port = plane.port
    outcome: list = []

    def fetch():
        try:
            fetcher.fetch(manifest, targets)
        except Exception as exc:  # noqa: BLE001 - what the fetch ended with is the test's to check
            outcome.append(exc)

    thread = threading.Thread(target=fetch, daemon=True)
    try:
        thread.start()
        wait_for(lambda: plane.stalled == 2, TIMEOUT_S, "both lanes receiving from the stalled data plane")
        fetcher.close()
        wait_for(lambda: not thread.is_alive(), TIMEOUT_S, "the fetch to end once its fetcher was closed")
        assert len(outcome) == 1 and not isinstance(outcome[0], AssertionError)
        with pytest.raises(FetchCancelled, match="closed"):  # and none starts after
            fetcher.fetch(manifest, targets)
    finally:
        plane.stop()
        fetcher.close()
