"""A sampler whose token the trainer accepts over gRPC fetches weights with it, whatever the token's length: one too
long for the TCP data plane's token field is never cut short there (refused as an unknown token, which the sampler
takes for a permanent refusal and stops), it fetches over FetchSlices instead."""

import hashlib
import logging
import time

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.rpc.auth import Caller, TokenTable
from grpo_stream.common.rpc.grpc_util import ClientSecurity, ServerSecurity, new_server, open_channel
from grpo_stream.common.weights import tcp_wire
from grpo_stream.common.weights.grpc_transport import GrpcFetcher
from grpo_stream.common.weights.snapshot import WeightSnapshot, WeightTransferError
from grpo_stream.protos import weights_pb2_grpc
from grpo_stream.trainer_service.publication.grpc_transport_server.data_plane import WeightDataServer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.publication.weight_service import WeightService

SHORT, LONG = "s" * 43, "l" * (tcp_wire.MAX_TOKEN_BYTES + 904)


@pytest.fixture
def trainer():
    """A WeightService and a data plane that both check tokens, serving version 0 of one (3, 4) tensor."""
    table = TokenTable([(hashlib.sha256(token.encode()).digest(), Caller(name, "sampler"))
                        for name, token in (("sampler-0", SHORT), ("sampler-1", LONG))])
    publisher = WeightPublisher()
    server = new_server(ServerSecurity(table=table))
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightService(publisher, table=table), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    data = WeightDataServer(publisher, "127.0.0.1", 0, table=table)
    data.start()
    publisher.publish(WeightSnapshot(0, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}))
    try:
        yield port, data
    finally:
        data.stop()
        server.stop(0)


@pytest.mark.parametrize("sampler_id, token, over_tcp", [("sampler-0", SHORT, True), ("sampler-1", LONG, False)],
                         ids=["short-token", "long-token"])
def test_a_token_grpc_accepts_fetches_weights_over_the_data_plane_or_grpc(trainer, caplog, sampler_id, token,
                                                                        over_tcp):
    port, data = trainer
    security = ClientSecurity(token=token)
    channel = open_channel(f"127.0.0.1:{port}", security)
    fetcher = GrpcFetcher(channel, sampler_id, 1, 10, data_host="127.0.0.1", security=security)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    try:
        with caplog.at_level(logging.WARNING):
            got = fetcher.fetch(fetcher.latest(-1), {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32, sharding=sharding)})
    finally:
        fetcher.close()
        channel.close()
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(12, dtype=np.float32).reshape(3, 4))
    if over_tcp:  # the data plane counts a transfer once its last send returns, which may be after the fetch has it
        deadline = time.monotonic() + 10
        while data.served_bytes < 48 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert (data.served_bytes == 48) is over_tcp
    assert over_tcp or "auth token is longer than its 4096 bytes" in caplog.text


def test_a_request_frame_never_cuts_a_token_short():
    with pytest.raises(WeightTransferError, match=r"token is 5000 bytes, more than the weights data plane's 4096"):
        tcp_wire.encode_request(b"", LONG)
    reader = tcp_wire.RequestReader()
    reader.feed(tcp_wire.encode_request(b"", "x" * tcp_wire.MAX_TOKEN_BYTES))
    assert reader.token == "x" * tcp_wire.MAX_TOKEN_BYTES and reader.request == b""


def test_grpc_refuses_the_long_token_of_no_one():
    """The long token passes above because the table holds it, not because gRPC skips the check."""
    table = TokenTable([(hashlib.sha256(SHORT.encode()).digest(), Caller("sampler-0", "sampler"))])
    server = new_server(ServerSecurity(table=table))
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightService(WeightPublisher(), table=table), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = open_channel(f"127.0.0.1:{port}", ClientSecurity(token=LONG))
    try:
        with pytest.raises(grpc.RpcError) as err:
            GrpcFetcher(channel, "sampler-1", 1, 10).latest(-1)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()
        server.stop(0)
