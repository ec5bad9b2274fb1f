"""The TCP data plane against peers that ask for a version and then never read it (a frozen sampler, one cut off by
the network, a hostile client), on real sockets on loopback: a transfer holds its version's host snapshot and a pool
thread, so such a peer must not hold them until the transfer's 10-minute deadline, nor keep a stopped trainer from
exiting."""

import socket
import threading

import numpy as np
import pytest

from grpo_stream.common.weights import tcp_wire
from grpo_stream.common.weights.snapshot import WeightSnapshot, box_to_proto
from grpo_stream.protos import weights_pb2
from grpo_stream.trainer_service.publication.grpc_transport_server.data_plane import WeightDataServer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from tests.support import wait_for

SHAPE = (2048, 4096)  # 32 MB: far more than the kernel buffers of a loopback connection hold


@pytest.fixture
def publisher():
    publisher = WeightPublisher()
    publisher.publish(WeightSnapshot(0, {"w": np.ones(SHAPE, np.float32)}))
    return publisher


def _never_reading_peer(port: int, publisher: WeightPublisher) -> socket.socket:
    """A connection that asks for the whole version and then reads nothing."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    request = weights_pb2.FetchSlicesRequest(sampler_id="frozen", version=0, trainer_epoch=publisher.epoch, tensors=[
        weights_pb2.TensorSlices(tensor_index=0, slices=[box_to_proto(tuple(slice(0, n) for n in SHAPE))])])
    sock.sendall(tcp_wire.encode_request(request.SerializeToString()))
    return sock


def _transfer_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("weights-data_")]


def test_stop_ends_a_transfer_whose_peer_never_reads(publisher):
    data = WeightDataServer(publisher, "127.0.0.1", 0, workers=2)
    port = data.start()
    peer = _never_reading_peer(port, publisher)
    try:
        wait_for(lambda: data.active_transfers == 1, 10, "the request to take a transfer slot")
        data.stop()
        # the pool's threads are joined when the process exits: one blocked sending would hold the exit for 600 s
        wait_for(lambda: data.active_transfers == 0 and not _transfer_threads(), 10,
                 "stop() to end the transfer blocked on a peer that never reads")
    finally:
        peer.close()
        data.stop()


def test_a_peer_that_stops_reading_loses_its_slot_and_version_after_the_stall_timeout(publisher):
    data = WeightDataServer(publisher, "127.0.0.1", 0, workers=1, stall_timeout_s=0.5)
    port = data.start()
    peer = _never_reading_peer(port, publisher)
    try:
        wait_for(lambda: data.active_transfers == 1, 10, "the request to take the only transfer slot")
        wait_for(lambda: data.active_transfers == 0, 10, "the stalled transfer to end (transfer_timeout_s is 600 s)")
        assert data.served_bytes == 0  # counted per whole slice: this one never went out whole
    finally:
        peer.close()
        data.stop()


def test_a_data_port_that_accepts_and_never_answers_is_not_tried_at_every_fetch(publisher):
    import jax
    import jax.numpy as jnp

    from grpo_stream.common.rpc.grpc_util import new_server, open_channel
    from grpo_stream.common.weights.grpc_transport import GrpcFetcher
    from grpo_stream.protos import weights_pb2_grpc
    from grpo_stream.trainer_service.publication.weight_service import WeightService

    silent = socket.create_server(("127.0.0.1", 0))  # a proxy or another service on the announced data port
    accepted = []
    threading.Thread(target=lambda: [accepted.append(silent.accept()) for _ in range(10)], daemon=True).start()
    publisher.data_port = silent.getsockname()[1]
    server = new_server(None)
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightService(publisher), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = open_channel(f"127.0.0.1:{port}", None)
    fetcher = GrpcFetcher(channel, "sampler-0", streams=1, timeout_s=2, data_host="127.0.0.1")
    targets = {"w": jax.ShapeDtypeStruct(SHAPE, jnp.float32, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0]))}
    try:
        for version in (1, 2):  # over gRPC after the silent port's status wait; the second without trying it again
            publisher.publish(WeightSnapshot(version, {"w": np.full(SHAPE, version, np.float32)}))
            got = fetcher.fetch(fetcher.latest(-1), targets)
            assert float(np.asarray(got["w"])[0, 0]) == version
        assert len(accepted) == 1
    finally:
        fetcher.close()
        channel.close()
        server.stop(0)
        silent.close()
        for conn, _ in accepted:
            conn.close()
