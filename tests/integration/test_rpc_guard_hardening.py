"""The gRPC guard against what a token holder or a stranger does on a real loopback server (common/rpc): a token
revoked or rotated in the table file counts without a restart, a table file that does not parse is refused without
quoting its tokens, one token under two names is refused, and idle connections without a token cannot take a
server's file descriptors."""

import socket

import grpc
import pytest
import yaml

from grpo_stream.common.rpc import grpc_util
from grpo_stream.common.rpc.auth import AuthError, TokenTable, write_private, write_tokens
from grpo_stream.common.rpc.grpc_util import ServerSecurity, bind, new_server
from tests.support import wait_for

METHOD = "/grpo_stream.v1.PromptService/GetStatus"


def _echo_server(table: TokenTable):
    security = ServerSecurity(table=table)
    server = new_server(security)
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request, lambda b: b, lambda b: b)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("grpo_stream.v1.PromptService",
                                                                          {"GetStatus": echo})])
    port = bind(server, "127.0.0.1", 0, security, "test.port")
    server.start()
    return server, port


def _code(channel, token: str) -> str:
    call = channel.unary_unary(METHOD, lambda b: b, lambda b: b)
    try:
        call(b"x", metadata=[("authorization", f"Bearer {token}")], timeout=10)
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


@pytest.fixture
def table_file(tmp_path):
    paths = write_tokens(tmp_path / "auth")
    tokens = {role: paths[role].read_text().strip() for role in ("client", "sampler", "admin")}
    return paths["table"], tokens


def test_a_token_revoked_or_rotated_in_the_table_file_counts_without_a_restart(table_file):
    path, tokens = table_file
    table = TokenTable.from_file(path)
    table.check_s = 0.0  # look at the file at every call
    server, port = _echo_server(table)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert _code(channel, tokens["client"]) == "OK"
            rows = yaml.safe_load(path.read_text())
            kept = [r for r in rows if r["role"] != "client"]  # the leaked client token revoked ...
            rotated = "r" * 40
            write_private(path, yaml.safe_dump([*kept, {"name": "client-2", "role": "client", "token": rotated}]))
            assert _code(channel, tokens["client"]) == "UNAUTHENTICATED"
            assert _code(channel, rotated) == "OK"  # ... and its successor served at once
            write_private(path, "- name: [broken\n")  # an edit that does not parse keeps the table in force
            assert _code(channel, rotated) == "OK"
            assert _code(channel, tokens["client"]) == "UNAUTHENTICATED"
    finally:
        server.stop(0)


def test_a_table_file_that_does_not_parse_is_refused_without_quoting_a_token(tmp_path):
    secret = "SECRET" * 6
    path = tmp_path / "tokens.yaml"
    path.write_text(f"- name: a\n  role: client\n  token: {secret}: oops\n")
    with pytest.raises(AuthError) as exc:
        TokenTable.from_file(path)
    assert "not valid YAML at line 3" in str(exc.value) and str(path) in str(exc.value)
    assert "SECRET" not in str(exc.value)


def test_one_token_under_two_names_is_refused(tmp_path):
    path = tmp_path / "tokens.yaml"
    path.write_text(yaml.safe_dump([{"name": "alice", "role": "client", "token": "t" * 32},
                                    {"name": "ops", "role": "admin", "token": "t" * 32}]))
    with pytest.raises(AuthError, match=r"entry 1 \(ops\) has the token of entry 0 \(alice\)"):
        TokenTable.from_file(path)


def test_connections_without_a_token_are_capped(table_file, monkeypatch):
    """Idle HTTP/2 connections cost a stranger nothing; without a cap they took a server's every descriptor."""
    monkeypatch.setattr(grpc_util, "MAX_CONNECTIONS", 16, raising=False)
    path, tokens = table_file
    server, port = _echo_server(TokenTable.from_file(path))
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)  # and an empty SETTINGS frame
    socks = []
    try:
        for _ in range(64):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(preface)
            socks.append(sock)

        def held() -> int:
            still = 0
            for sock in socks:
                sock.setblocking(False)
                try:
                    while sock.recv(65536):  # the server's SETTINGS; b"" once it closed the connection
                        pass
                except BlockingIOError:
                    still += 1
                except OSError:
                    pass
            return still

        wait_for(lambda: held() <= 16, 30, "the server to close the connections beyond its cap")
        for sock in socks:
            sock.close()
        socks.clear()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            wait_for(lambda: _code(channel, tokens["client"]) == "OK", 30, "a token's call once the strangers left")
    finally:
        for sock in socks:
            sock.close()
        server.stop(0)
