"""The sampler's OpenAI-compatible endpoint attacked as a stranger and as a heavy client, over real HTTP on loopback
(the tiny Qwen-family chat model on the JAX engine, the endpoint's own uvicorn server): unfinished request heads (first
or later ones on a kept-alive connection), stalled bodies, floods of connections, megabyte prompts, JSON nested past
the parser, malformed messages, clients that leave before their answer, one token holding every place, the in-memory
token of the sampler's own rollouts, a sampler's token. Each is refused, closed or freed by its limit, with errors in
OpenAI's shape, and a legitimate client is served meanwhile."""

import concurrent.futures
import json
import logging
import resource
import socket
import time
import threading
import tracemalloc

import httpx
import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.endpoint.chat import ChatPrompts
from grpo_stream.common.engine import continuous
from grpo_stream.common.rpc.auth import write_tokens
from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.sampler_service.endpoint_listener import OWN_DESCRIPTORS
from grpo_stream.sampler_service.openai_server import openai_endpoint
from tests.chat_families import chat_family_dirs  # noqa: F401 - a fixture
from tests.conftest import CONFIGS
from tests.support import endpoint_overrides, wait_for

HEADER_TIMEOUT_S, BODY_TIMEOUT_S, PER_ADDRESS = 1.5, 1.5, 24


@pytest.fixture(scope="module")
def served(chat_family_dirs, tmp_path_factory):  # noqa: F811
    tokens = write_tokens(tmp_path_factory.mktemp("auth"))
    cfg = load_config(CONFIGS / "tiny_arith.yaml", endpoint_overrides(
        chat_family_dirs["qwen"], tokens["table"], "sampler.openai.max_concurrent=4",
        f"sampler.openai.header_timeout_s={HEADER_TIMEOUT_S}", f"sampler.openai.body_timeout_s={BODY_TIMEOUT_S}",
        f"sampler.openai.max_connections_per_address={PER_ADDRESS}", "sampler.openai.max_connections=1024"))
    _, tok = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tok.vocab_size, seed=0)
    engine = continuous.build(cfg, model, tok)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))  # the default a sampler starts with
    try:
        with openai_endpoint(cfg, 0, "sampler-0", engine, tok, lambda: (model.params, 1), None) as endpoint:
            yield endpoint, {role: tokens[role].read_text().strip() for role in ("client", "sampler", "admin")}
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), hard))


def address(endpoint) -> tuple[str, int]:
    return "127.0.0.1", int(endpoint.url.rsplit(":", 1)[1].split("/")[0])


def completion(endpoint, token: str, **body) -> httpx.Response:
    return httpx.post(endpoint.url + "/completions", headers={"Authorization": f"Bearer {token}"}, timeout=60,
                      json={"model": "policy", "prompt": "Add 2 and 3.", "max_tokens": 2, **body})


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    sock.settimeout(within_s)
    try:
        return sock.recv(1) == b""
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_the_open_file_limit_leaves_room_for_the_connections_and_the_samplers_own_work(served):
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 1024 + OWN_DESCRIPTORS


def test_unfinished_heads_are_closed_by_their_deadline(served):
    endpoint, tokens = served
    timed_out = endpoint.limits.timed_out
    stalled = []
    try:
        for _ in range(PER_ADDRESS):
            sock = socket.create_connection(address(endpoint))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head never finished
            stalled.append(sock)
        # the head deadline closes every stalled connection (uvicorn alone keeps them for ever)
        assert all(closed_by_server(sock, HEADER_TIMEOUT_S + 5) for sock in stalled)
        assert endpoint.limits.timed_out - timed_out == PER_ADDRESS
        assert completion(endpoint, tokens["client"]).status_code == 200
    finally:
        for sock in stalled:
            sock.close()


def test_a_flood_is_capped_per_address(served):
    endpoint, tokens = served
    # a deadline far beyond the test's length, so the cap and not the deadline is what closes the extra connection
    # however slowly a loaded machine opens the others
    endpoint.limits.header_timeout_s = 600
    refused = endpoint.limits.refused
    stalled = []
    try:
        for _ in range(PER_ADDRESS):
            stalled.append(socket.create_connection(address(endpoint)))
        wait_for(lambda: endpoint.limits.open_now() == PER_ADDRESS, 30, "the server to hold the stalled connections")
        extra = socket.create_connection(address(endpoint))
        assert closed_by_server(extra, 5), "a connection beyond the per-address cap was kept"
        extra.close()
        assert endpoint.limits.refused - refused == 1
    finally:
        endpoint.limits.header_timeout_s = HEADER_TIMEOUT_S
        for sock in stalled:
            sock.close()
    wait_for(lambda: endpoint.limits.open_now() == 0, 30, "the closed connections to leave the per-address count")
    assert completion(endpoint, tokens["client"]).status_code == 200


def test_an_idle_connection_outlives_the_openai_sdks_own_keep_alive(served):
    """The openai SDK's pool (httpx) drops an idle connection after its keepalive_expiry; a server that closed one
    sooner or at the same time would let a client send on a connection as it is being closed (it reads 'Server
    disconnected', issue 55's live test saw it)."""
    endpoint, tokens = served
    seen = []
    with httpx.Client(base_url=endpoint.url, headers={"Authorization": f"Bearer {tokens['client']}"}, timeout=60,
                      limits=httpx.Limits(max_connections=1, keepalive_expiry=None)) as client:
        body = {"model": "policy", "prompt": "Add 2 and 3.", "max_tokens": 2}
        assert client.post("/completions", json=body).status_code == 200
        time.sleep(httpx.Limits().keepalive_expiry + 1)
        second = client.post("/completions", json=body, extensions={"trace": lambda name, info: seen.append(name)})
        assert second.status_code == 200
    assert "connection.connect_tcp.started" not in seen  # the same connection carried the second request


def test_stalled_bodies_hold_no_place_and_are_answered_408(served, caplog):
    endpoint, tokens = served
    stalled = []
    try:
        for _ in range(8):  # twice sampler.openai.max_concurrent
            sock = socket.create_connection(address(endpoint))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + tokens["client"].encode() + b"\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            stalled.append(sock)
        time.sleep(0.3)
        assert completion(endpoint, tokens["client"]).status_code == 200  # the gate was not taken by them
        for sock in stalled:
            sock.settimeout(BODY_TIMEOUT_S + 10)
            assert sock.recv(4096).startswith(b"HTTP/1.1 408")
        # a client that leaves mid-body is one line in the log, not a traceback
        with caplog.at_level(logging.INFO):
            sock = socket.create_connection(address(endpoint))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + tokens["client"].encode() + b"\r\nContent-Length: 100\r\n\r\n{")
            time.sleep(0.3)
            sock.close()
            time.sleep(0.5)
        assert not any(r.exc_info for r in caplog.records)
        assert any("left before sending its whole body" in r.getMessage() for r in caplog.records)
    finally:
        for sock in stalled:
            sock.close()


def test_a_megabyte_prompt_is_refused_by_its_characters_before_tokenizing(served):
    endpoint, tokens = served
    answer = completion(endpoint, tokens["client"], prompt="12 + 7 = ? " * 350_000)
    assert answer.status_code == 400 and "prompt: 3850000 characters" in answer.json()["error"]["message"]
    big = httpx.post(endpoint.url + "/chat/completions", headers={"Authorization": f"Bearer {tokens['client']}"},
                     json={"model": "policy", "messages": [{"role": "user", "content": "x" * 200_000}]}, timeout=60)
    assert big.status_code == 400 and "messages: 2000" in big.json()["error"]["message"] \
        and "max_prompt_chars=1536" in big.json()["error"]["message"]


def test_json_nested_past_the_parser_is_a_400(served):
    endpoint, tokens = served
    deep = b"[" * 200_000 + b"]" * 200_000
    answer = httpx.post(endpoint.url + "/completions", headers={"Authorization": f"Bearer {tokens['client']}"},
                        content=deep, timeout=60)
    assert answer.status_code in (400, 413) and "error" in answer.json()
    nested = b'{"model": "policy", "prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}"
    answer = httpx.post(endpoint.url + "/completions", headers={"Authorization": f"Bearer {tokens['client']}"},
                        content=nested, timeout=60)
    assert answer.status_code == 400 and "nests too deep" in answer.json()["error"]["message"]


def test_the_internal_token_is_refused_on_the_listener_and_a_sampler_token_is_forbidden(served):
    endpoint, tokens = served
    assert completion(endpoint, endpoint.internal_token).status_code == 401
    refused = completion(endpoint, tokens["sampler"])
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "permission_error"


def test_remembered_chats_are_bounded_in_bytes_ambiguous_ones_included():
    class Plain:
        has_chat_template = False

    chats = ChatPrompts(Plain(), max_bytes=2 << 20)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(20_000):
        messages = [{"role": "user", "content": f"question {i}"}]
        answer = {"role": "assistant", "content": "the same answer"}
        chats.remember(messages, answer, None, list(range(40)), True, caller="c")
        if i % 2:  # the same visible answer with other ids: an ambiguous entry, kept without ids
            chats.remember(messages, answer, None, list(range(41)), True, caller="c")
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert chats.held_bytes <= 2 << 20 and held <= 1.25 * (2 << 20), held
    assert sum(entry is None for entry in chats._remembered.values()) > 0
    assert np.array_equal(next(e for e in reversed(chats._remembered.values()) if e is not None)[0], np.arange(40))


def read_response(sock: socket.socket, within_s: float) -> bytes:
    """One whole HTTP response (head and Content-Length body) from `sock`."""
    sock.settimeout(within_s)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def test_a_later_unfinished_head_on_a_kept_alive_connection_is_closed_by_its_deadline(served):
    endpoint, _ = served
    timed_out = endpoint.limits.timed_out
    with socket.create_connection(address(endpoint)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # no token: a 401, and the connection is kept
        assert read_response(sock, 30).startswith(b"HTTP/1.1 401")
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a second head, never finished
        # keep_alive_s is 30 s, and uvicorn stops that timer at the head's first byte: only the head deadline closes it
        assert closed_by_server(sock, HEADER_TIMEOUT_S + 5), "a half-sent second head held its connection"
    assert endpoint.limits.timed_out - timed_out == 1


def test_a_client_that_leaves_frees_its_place_and_its_sequences_at_once(served, caplog):
    endpoint, tokens = served
    gate, queue = endpoint.app.state.gate, endpoint.queue
    body = json.dumps({"model": "policy", "prompt": "Add 2 and 3.", "max_tokens": 8, "n": 4}).encode()
    with caplog.at_level(logging.INFO), queue.engine:  # the engine is busy elsewhere: the sequences wait for it
        sock = socket.create_connection(address(endpoint))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + tokens["client"].encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        wait_for(lambda: gate.open == 1 and queue.has(), 30, "the request to wait for the engine")
        sock.close()  # the client gives up
        wait_for(lambda: gate.open == 0 and not queue.has(), 30, "its place and its queued sequences to be freed")
    assert any("left before its answer" in r.getMessage() for r in caplog.records)
    assert not any(r.exc_info for r in caplog.records)
    assert completion(endpoint, tokens["client"]).status_code == 200


def test_one_token_cannot_take_every_place(served):
    """max_concurrent=4, so a token may hold 2 (max_concurrent_per_token's default): its third request is refused at
    once while another token's is still admitted."""
    endpoint, tokens = served
    gate, headers = endpoint.app.state.gate, {"Authorization": f"Bearer {tokens['client']}"}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        with endpoint.queue.engine:  # the engine busy: admitted requests stay open
            held = [pool.submit(completion, endpoint, tokens["client"]) for _ in range(2)]
            wait_for(lambda: gate.open == 2, 30, "the client's two requests to be open")
            third = httpx.post(endpoint.url + "/completions", headers=headers, timeout=20,
                               json={"model": "policy", "prompt": "Add 2 and 3.", "max_tokens": 2})
            assert third.status_code == 429 and third.headers["retry-after"] == "1"
            assert "max_concurrent_per_token=2" in third.json()["error"]["message"]
            other = pool.submit(completion, endpoint, tokens["admin"])
            wait_for(lambda: gate.open == 3, 30, "another token's request to be admitted")
        assert [f.result().status_code for f in held + [other]] == [200, 200, 200]


@pytest.mark.parametrize("ask, field", [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
                                        ({"n": True}, "n"), ({"stop": ["a"] * 33}, "stop"), ({"stop": [1]}, "stop"),
                                        # JSON's true and 2.0 are no token ids (lax pydantic read them as 1 and 2)
                                        ({"prompt": [True, 5]}, "prompt"), ({"prompt": [[3, 2.0]]}, "prompt")])
def test_a_refused_field_is_named_in_param_with_openais_error_type(served, ask, field):
    endpoint, tokens = served
    answer = completion(endpoint, tokens["client"], **ask)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["type"] == "invalid_request_error" and error["param"] == field
    assert error["message"].startswith(field + ":")  # the field, never pydantic's name of a union's branch
    assert "Value error" not in error["message"] and not error["message"].startswith(f"{field}: {field}:")


def test_a_body_that_is_not_utf8_is_a_400_saying_so(served):
    endpoint, tokens = served
    answer = httpx.post(endpoint.url + "/completions", headers={"Authorization": f"Bearer {tokens['client']}"},
                        content=b'{"model": "policy", "prompt": "\xff\xfe"}', timeout=60)
    assert answer.status_code == 400 and "not UTF-8" in answer.json()["error"]["message"]


def test_a_number_longer_than_python_reads_is_a_400_that_gives_the_server_no_advice(served):
    endpoint, tokens = served
    answer = httpx.post(endpoint.url + "/completions", headers={"Authorization": f"Bearer {tokens['client']}"},
                        content=b'{"model": "policy", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", timeout=60)
    message = answer.json()["error"]["message"]
    assert answer.status_code == 400 and "no field takes one that long" in message
    assert "set_int_max_str_digits" not in message  # Python's advice is for the server's code, not its client


@pytest.mark.parametrize("route, body, field", [
    ("/completions", b'{"model": "policy", "prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/chat/completions", b'{"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
     b'"tools": [{"type": "function", "function": {"name": "\\udfff"}}]}', "tools[0].function.name")])
def test_an_unpaired_surrogate_is_a_400_naming_its_field_not_a_fault_of_ours(served, route, body, field):
    endpoint, tokens = served  # JSON's escapes allow one; the tokenizer raised on it (a 500 and an error line each)
    answer = httpx.post(endpoint.url + route, headers={"Authorization": f"Bearer {tokens['client']}"}, content=body,
                        timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == field, answer.text


@pytest.mark.parametrize("calls", [5, [{"id": "c", "type": "function",
                                        "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]])
def test_malformed_tool_calls_are_a_400_naming_them(served, calls):
    endpoint, tokens = served
    messages = [{"role": "assistant", "content": "x", "tool_calls": calls}, {"role": "user", "content": "hi"}]
    answer = httpx.post(endpoint.url + "/chat/completions", headers={"Authorization": f"Bearer {tokens['client']}"},
                        json={"model": "policy", "messages": messages, "max_tokens": 2}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages[0].tool_calls"


def test_a_fault_of_the_endpoint_is_a_500_in_openais_shape_and_one_log_line(served, caplog, monkeypatch):
    endpoint, tokens = served

    async def broken(request, caller=""):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(endpoint.core, "completion", broken)
    with caplog.at_level(logging.INFO):
        answer = completion(endpoint, tokens["client"])
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
    logged = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(logged) == 1 and "KeyError" in logged[0].getMessage() and not logged[0].exc_info


def _server_side(endpoint, sock: socket.socket):
    """The server's protocol of the connection `sock` is the client end of, or None once the server dropped it."""
    for _ in range(10):
        try:
            return next((p for p in list(endpoint.server.server_state.connections)
                         if tuple(p.client or ()) == sock.getsockname()), None)
        except RuntimeError:  # the set changed while copied: look again
            continue
    return None


@pytest.mark.parametrize("stream, high_water", [(True, 1024), (False, 1 << 20)])
def test_a_client_that_never_takes_its_answer_is_closed_by_the_send_deadline(served, stream, high_water):
    """A client that never reads held its connection and its answer's bytes for ever: uvicorn waits on a paused
    transport without a deadline (stream: true), and closes one holding unsent bytes only once they are sent (a
    whole JSON answer queued below the write high-water mark). The server's buffers are shrunk so a small answer
    outgrows them, as a long one outgrows the real ones."""
    endpoint, tokens = served
    aborted = endpoint.limits.send_timed_out
    body = json.dumps({"model": "policy", "prompt": list(range(100, 190)), "n": 48, "max_tokens": 2, "logprobs": 0,
                       "return_token_ids": True, "stream": stream}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # and it never reads
    try:
        with endpoint.queue.engine:  # the answer waits until the server's buffers are small
            sock.connect(address(endpoint))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         + tokens["client"].encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            wait_for(lambda: _server_side(endpoint, sock) is not None, 30, "the server to accept the connection")
            proto, shrunk = _server_side(endpoint, sock), threading.Event()

            def shrink():
                proto.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                proto.transport.set_write_buffer_limits(high=high_water)
                shrunk.set()

            proto.loop.call_soon_threadsafe(shrink)
            assert shrunk.wait(10)
        wait_for(lambda: _server_side(endpoint, sock) is None, 120, "the server to drop the client that never reads")
        assert endpoint.limits.send_timed_out - aborted == 1
    finally:
        sock.close()
    assert completion(endpoint, tokens["client"]).status_code == 200
