"""PromptClient against servers that fail, stall or are absent: every call ends, with the server's own error, within
the time the caller gave it (real gRPC on loopback; a stand-in PromptService on the guarded server of grpc_util)."""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from grpo_stream.client.errors import explain
from grpo_stream.client.prompts import PromptClient
from grpo_stream.common.rpc.grpc_util import ClientSecurity, ServerSecurity, bind, new_server
from grpo_stream.protos import prompts_pb2_grpc
from tests.support import in_thread


class StandIn(prompts_pb2_grpc.PromptServiceServicer):
    """Submit answers RESOURCE_EXHAUSTED with `retry_after_ms` as its hint; StreamResults fails at once (a server
    bug: UNKNOWN naming it); `submits` counts the calls."""

    def __init__(self, retry_after_ms: str = "100"):
        self.retry_after_ms, self.submits, self.streams = retry_after_ms, 0, 0

    def Submit(self, request, context):
        self.submits += 1
        context.set_trailing_metadata((("retry-after-ms", self.retry_after_ms),))
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt queue full")

    def StreamResults(self, request, context):
        self.streams += 1
        raise RuntimeError("the follower crashed on this prompt")


@pytest.fixture
def stand_in():
    servicer = StandIn()
    server = new_server(ServerSecurity())
    prompts_pb2_grpc.add_PromptServiceServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1", 0, None, "test.port")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def finishes_within(seconds: float, fn):
    """(what `fn` raised or returned, seconds it took); fails when it is still running after `seconds`."""
    started = time.monotonic()
    done, value = in_thread(fn, seconds)
    assert done, f"still running {seconds} s later"
    return value, time.monotonic() - started


def test_a_huge_or_negative_retry_hint_neither_sleeps_past_retry_s_nor_crashes(stand_in):
    """A server's retry-after-ms of 10^11 had submit() sleep ~3 years whatever retry_s said; -5 raised
    ValueError('sleep length must be non-negative'), which the CLI reports as bad input."""
    servicer, address = stand_in
    with PromptClient(address) as client:
        servicer.retry_after_ms = "100000000000"
        error, took = finishes_within(10, lambda: client.submit([{"text": "Q: 1 A:"}], retry_s=1))
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert took < 5 and servicer.submits == 1
        servicer.retry_after_ms, servicer.submits = "-5", 0
        error, took = finishes_within(10, lambda: client.submit([{"text": "Q: 1 A:"}], retry_s=1))
        assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert 2 <= servicer.submits <= 12  # retried with a floor between calls, not in a busy loop


def test_a_request_over_the_message_limit_is_not_retried_and_not_called_a_full_queue(stand_in):
    """grpc answers an oversized message RESOURCE_EXHAUSTED, as a full queue: it was retried for retry_s, then
    reported as 'the prompt queue ... is full; retry later' (exit 1) although it can never fit."""
    servicer, address = stand_in
    with PromptClient(address) as client:
        big = [{"text": "x" * (1 << 20)} for _ in range(65)]
        error, took = finishes_within(30, lambda: client.submit(big, retry_s=20))
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and took < 15
    worded = explain(error, address)
    assert isinstance(worded, ValueError) and "gRPC message limit" in str(worded) and "--batch" in str(worded)
    assert servicer.submits == 0


def test_following_a_server_that_fails_every_stream_ends_after_reconnect_s(stand_in):
    """A server failing every StreamResults at once (channel ready each time) was followed again forever: the
    window was counted anew at each break. Now the error is raised once the next try would start past reconnect_s
    after the first break (tries at about 0, 0.5, 1.5 and 3.5 s)."""
    servicer, address = stand_in
    broke = []
    with PromptClient(address) as client:
        error, took = finishes_within(30, lambda: list(client.follow(["p-1"], reconnect_s=6,
                                                                     on_reconnect=broke.append)))
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNKNOWN
    assert "crashed" in error.details() or "Exception" in error.details()
    assert took < 12 and 2 <= servicer.streams <= 8 and len(broke) == servicer.streams - 1


@pytest.mark.parametrize("how", ["follow", "results"])
def test_following_where_no_server_listens_fails_after_the_wait(how):
    """StreamResults was wait_for_ready without a deadline: `grpo-stream results ID --wait 2` with no server at the
    address (or one gone for good) waited forever instead of exiting 1 with UNAVAILABLE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    with PromptClient(address, timeout_s=2) as client:
        call = (lambda: list(client.follow(["p-1"], reconnect_s=2))) if how == "follow" else \
            (lambda: list(client.results(tag="probe")))
        error, took = finishes_within(30, call)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
    assert 1.5 <= took < 15
    assert "no answer from" in str(explain(error, address))


def test_the_token_is_not_in_the_client_security_repr():
    """A dataclass repr carried the bearer token into any log line, traceback with locals or debug print."""
    security = ClientSecurity(token="s3cret-token-0123456789")
    assert "s3cret" not in repr(security) and "s3cret" not in str(security)
    assert security.token == "s3cret-token-0123456789"

