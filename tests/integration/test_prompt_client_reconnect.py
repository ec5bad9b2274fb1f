"""PromptClient finding a server that comes (back) up within the caller's wait, whatever gRPC's own reconnect back-off
says (real gRPC on loopback; a stand-in PromptService on the guarded server of grpc_util)."""

from __future__ import annotations

import socket
import threading

import grpc
import pytest

from grpo_stream.client.prompts import PromptClient
from grpo_stream.common.rpc import grpc_util
from grpo_stream.common.rpc.grpc_util import ServerSecurity, bind, new_server
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc
from tests.support import wait_for

# a channel's reconnect back-off after a failed connect; gRPC's own grows 1.6x per failure up to 120 s, so after a
# minute of outage its next try comes tens of seconds after the server is back. A long first step stands in for that.
LONG_BACKOFF = [("grpc.initial_reconnect_backoff_ms", 60_000), ("grpc.min_reconnect_backoff_ms", 60_000),
                ("grpc.max_reconnect_backoff_ms", 60_000)]


class Answering(prompts_pb2_grpc.PromptServiceServicer):
    def StreamResults(self, request, context):
        for pid in request.prompt_ids:
            yield prompts_pb2.PromptResult(prompt_id=pid, state="done")

    def GetStatus(self, request, context):
        return prompts_pb2.RunStatus(run_name="back")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_later(port: int, started: threading.Event) -> list:
    """A server on `port` once `started` is set (by the test, after the client's first connect failed)."""
    servers = []

    def run():
        started.wait(60)
        server = new_server(ServerSecurity())
        prompts_pb2_grpc.add_PromptServiceServicer_to_server(Answering(), server)
        bind(server, "127.0.0.1", port, None, "test.port")
        server.start()
        servers.append(server)

    threading.Thread(target=run, daemon=True).start()
    return servers


def first_connect_failed(client: PromptClient) -> bool:
    """Wait until the client's channel has tried the empty port and failed (then its back-off runs)."""
    failed = threading.Event()

    def seen(state):
        if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            failed.set()

    client.channel.subscribe(seen, try_to_connect=True)
    try:
        return failed.wait(30)
    finally:
        client.channel.unsubscribe(seen)


def test_closing_a_client_leaves_no_grpc_thread_to_die(monkeypatch):
    """A channel closed while gRPC's connectivity poller (behind `subscribe`) still looked at it killed that thread
    with "ValueError: Cannot monitor channel state: Channel closed!" on stderr: closing a client that had waited for
    its channel, or one closed before any call."""
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    server = new_server(ServerSecurity())
    prompts_pb2_grpc.add_PromptServiceServicer_to_server(Answering(), server)
    port = bind(server, "127.0.0.1", 0, None, "test.port")
    server.start()
    before = {t.ident for t in threading.enumerate()}

    def clients_threads():  # gRPC's pollers and deliveries, the closers (not the server's pool)
        return [t for t in threading.enumerate() if t.ident not in before
                and not t.name.startswith(("grpc-server", "rpc-first-message"))]
    try:
        for k in range(60):
            with PromptClient(f"127.0.0.1:{port}", timeout_s=10) as client:
                for _ in range(k % 3):  # none, one and two calls before the close
                    assert client.status().run_name == "back"
        closed = PromptClient(f"127.0.0.1:{port}")
        closed.close()
        wait_for(lambda: not clients_threads(), 30, "the clients' pollers and closers to end")
    finally:
        server.stop(0)
    assert not died, [str(d.exc_value) for d in died]


@pytest.mark.parametrize("call", ["follow", "status"])
def test_a_server_up_within_the_wait_is_found_though_the_channel_backs_off(call, monkeypatch):
    """A server still starting (or restarting) when the client first tried was found only at the channel's next
    reconnect: gRPC backs off 1.6x per failed connect up to 120 s, so `submit`/`status --wait 60` before a trainer
    that takes 50 s to start, or following across a 50 s restart, failed UNAVAILABLE / DEADLINE_EXCEEDED at 60 s
    with the server answering since 50 s."""
    monkeypatch.setattr(grpc_util, "CHANNEL_OPTIONS", [*grpc_util.CHANNEL_OPTIONS, *LONG_BACKOFF])
    port, started = free_port(), threading.Event()
    servers = serve_later(port, started)
    try:
        with PromptClient(f"127.0.0.1:{port}", timeout_s=10) as client:
            assert first_connect_failed(client)
            started.set()
            if call == "follow":
                got = [r.prompt_id for r in client.follow(["p-1", "p-2"], reconnect_s=10)]
                assert got == ["p-1", "p-2"]
            else:
                assert client.status().run_name == "back"
    finally:
        for server in servers:
            server.stop(0)
