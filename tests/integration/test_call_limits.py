"""Calls a server serves at once (common/rpc/call_guard.py, config section rpc), attacked on a real server with real
Redis: prompt clients and bulk weight fetches that fill their own kinds while a sampler's rollouts still go through;
one token that cannot take a whole kind; unary calls whose request never comes, cancelled; reflection for admins
only; and the weights TCP data plane, whose transfer slots idle connections without a token cannot hold."""

import socket
import time

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from grpo_stream.common.rpc.auth import ROLES_BY_METHOD, write_tokens
from grpo_stream.common.weights import tcp_wire
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc, weights_pb2
from tests.half_sent import HalfSentCalls, PartialBodies
from tests.support import serve, wait_for, with_run_name

pytestmark = pytest.mark.redis
INGEST, WEIGHTS, PROMPTS = ("/grpo_stream.v1.RolloutIngest/", "/grpo_stream.v1.WeightService/",
                            "/grpo_stream.v1.PromptService/")


def limited(tiny_parts, redis_url, run_name, tmp_path, rpc=None, max_followers=None, data_plane=False):
    """A server with a token per sampler (sampler-0, sampler-1) and the given rpc limits."""
    cfg, task, tokenizer, _ = tiny_parts
    paths = write_tokens(tmp_path / "table", samplers=2)
    cfg = with_run_name(cfg, run_name)
    cfg = cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"tokens_file": str(paths["table"])})})
    if rpc:
        cfg = cfg.model_copy(update={"rpc": cfg.rpc.model_validate({**cfg.rpc.model_dump(), **rpc})})
    if max_followers:
        cfg = cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update={"max_followers": max_followers})})
    return serve(cfg, redis_url, tmp_path / "unused", task, tokenizer, data_plane=data_plane), paths


def code_of(call) -> str:
    return call.code().name if call.done() else "open"


def sampler_works(stack, token: str, sampler_id: str = "sampler-0") -> None:
    """Admission, an (empty) rollout stream and the manifest answer within 5 s."""
    from grpo_stream.protos import weights_pb2_grpc  # noqa: PLC0415

    channel = stack.channel(None, token)
    ingest = rollout_pb2_grpc.RolloutIngestStub(channel)
    ingest.Admit(rollout_pb2.AdmitRequest(sampler_id=sampler_id, groups=1), timeout=5)
    assert list(ingest.StreamBatches(iter([]), timeout=5)) == []
    weights_pb2_grpc.WeightServiceStub(channel).GetManifest(
        weights_pb2.GetManifestRequest(sampler_id=sampler_id, installed_version=-1), timeout=5)


def test_every_rpc_has_a_kind():
    from grpo_stream.common.rpc.call_guard import KIND_BY_METHOD  # noqa: PLC0415

    ours = {m for m in ROLES_BY_METHOD if m.startswith("/grpo_stream.")}
    assert ours == {m for m in KIND_BY_METHOD if m.startswith("/grpo_stream.")}, ours ^ set(KIND_BY_METHOD)


def test_prompt_clients_and_weight_fetches_cannot_starve_ingest(tiny_parts, shared_redis, run_name, tmp_path):
    server, paths = limited(tiny_parts, shared_redis.url, run_name, tmp_path, rpc={
        "prompt_calls": 4, "weight_fetches": 4, "calls_per_caller": 100}, max_followers=4)
    with server as stack:
        stack.tokens = paths
        hostile = HalfSentCalls(stack.address)
        try:
            # two tokens per kind: one token may hold only half a kind's slots
            client, sampler_1, admin = stack.token("client"), stack.token("sampler-1"), stack.token("admin")
            held = [hostile.open("prompt", PROMPTS + "Submit", token) for token in (client, admin) * 2]
            held += [hostile.open("follow", PROMPTS + "StreamResults", token, True) for token in (client, admin) * 2]
            held += [hostile.open("fetch", WEIGHTS + "FetchSlices", token, True) for token in (sampler_1, admin) * 2]
            # each kind full: the next call of it is refused at once, naming the setting
            for what, path, token, streaming, setting in (
                    ("prompt", PROMPTS + "GetStatus", client, False, "rpc.prompt_calls"),
                    ("follow", PROMPTS + "StreamResults", client, True, "prompts.max_followers"),
                    ("fetch", WEIGHTS + "FetchSlices", stack.token("sampler-0"), True, "rpc.weight_fetches")):
                extra = hostile.open(what, path, token, streaming)
                wait_for(extra.done, 5, f"a {what} call beyond its kind's limit to be refused")
                assert extra.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and setting in extra.details()
            assert [code_of(call) for call in held] == ["open"] * 12
            sampler_works(stack, stack.token("sampler-0"))  # the samplers' own kind is untouched
        finally:
            hostile.close()
        # the slots come back when the calls end
        fetch = stack.channel(None, stack.token("sampler-0")).unary_stream(WEIGHTS + "FetchSlices")
        wait_for(lambda: _fetches(fetch), 10, "a fetch to be served once the held ones ended")


def _fetches(fetch) -> bool:
    try:
        list(fetch(weights_pb2.FetchSlicesRequest(sampler_id="sampler-0", version=0, tensors=[weights_pb2.TensorSlices(
            tensor_index=0, slices=[weights_pb2.SliceRange(start=[0, 0], stop=[3, 4])])]).SerializeToString(),
            timeout=5))
        return True
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return False


def test_one_token_cannot_take_a_whole_kind(tiny_parts, shared_redis, run_name, tmp_path):
    server, paths = limited(tiny_parts, shared_redis.url, run_name, tmp_path, rpc={"calls_per_caller": 3})
    with server as stack:
        stack.tokens = paths
        hostile = HalfSentCalls(stack.address)
        try:
            streams = [hostile.open("stream", INGEST + "StreamBatches", stack.token("sampler-1"), True)
                       for _ in range(4)]
            wait_for(lambda: sum(s.done() for s in streams) == 1, 5, "the 4th stream of one token to be refused")
            refused = next(s for s in streams if s.done())
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "sampler-1" in refused.details() and "rpc.calls_per_caller" in refused.details()
            sampler_works(stack, stack.token("sampler-0"))  # another sampler's token is served
        finally:
            hostile.close()


def test_health_watch_streams_cannot_refuse_health_checks_nor_one_token_take_half_a_kind(
        tiny_parts, shared_redis, run_name, tmp_path):
    """Watch streams never end: one token holds at most half the ops slots whatever rpc.calls_per_caller says, and
    with every ops slot held, health Check (what a starting sampler and a platform probe call) is still served."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

    server, paths = limited(tiny_parts, shared_redis.url, run_name, tmp_path)  # 32 per caller, 16 ops calls
    with server as stack:
        stack.tokens = paths
        watches = []
        try:
            for name, count in (("client", 9), ("sampler-1", 8)):
                health = health_pb2_grpc.HealthStub(stack.channel(None, stack.token(name)))
                for _ in range(count):
                    watches.append(health.Watch(health_pb2.HealthCheckRequest(service="")))
                    if len(watches) != 9:
                        assert next(watches[-1]).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as ninth:  # client's 9th: its share of 16 is 8
                next(watches[8])
            assert ninth.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "client already has 8 ops calls open (rpc.calls_per_caller" in ninth.value.details()
            probe = health_pb2_grpc.HealthStub(stack.channel(None, stack.token("sampler-0")))
            with pytest.raises(grpc.RpcError) as full:
                next(probe.Watch(health_pb2.HealthCheckRequest(service="")))
            assert "already serves 16 ops calls" in full.value.details()
            assert probe.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        finally:
            for watch in watches:
                watch.cancel()


def test_a_unary_call_whose_request_never_comes_is_cancelled(tiny_parts, shared_redis, run_name, tmp_path):
    server, paths = limited(tiny_parts, shared_redis.url, run_name, tmp_path,
                            rpc={"calls_per_caller": 3, "first_message_timeout_s": 1.0})
    with server as stack:
        stack.tokens = paths
        token = stack.token("sampler-1")
        host, port = stack.address.rsplit(":", 1)
        hostile = HalfSentCalls(stack.address)
        partial = PartialBodies(host, int(port), INGEST + "Admit", token, 1)  # 9 bytes of a 1,000-byte request
        try:
            held = [hostile.open("admit", INGEST + "Admit", token) for _ in range(2)]
            started = time.monotonic()
            wait_for(lambda: all(call.done() for call in held), 10, "the held unary calls to be cancelled")
            assert [call.code() for call in held] == [grpc.StatusCode.CANCELLED] * 2
            assert time.monotonic() - started >= 0.5  # held first, not refused
            wait_for(lambda: partial.outcome()["open"] == 0, 10, "the partial request to be ended")
            # their slots are free again: the same token is served in full
            sampler_works(stack, token, "sampler-1")
        finally:
            hostile.close()
            partial.close()


def test_reflection_answers_admins_only(tiny_parts, shared_redis, run_name, tmp_path):
    server, paths = limited(tiny_parts, shared_redis.url, run_name, tmp_path)
    with server as stack:
        stack.tokens = paths

        def services(key: str):
            stub = reflection_pb2_grpc.ServerReflectionStub(stack.channel(None, stack.token(key)))
            replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                timeout=5)
            return {s.name for r in replies for s in r.list_services_response.service}

        assert "grpo_stream.v1.PromptService" in services("admin")
        for key in ("client", "sampler-0"):
            with pytest.raises(grpc.RpcError) as err:
                services(key)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, key


def fetch_over_data_plane(port: int, token: str) -> tuple[int, bytes]:
    """(status, the slice's bytes) of the 3x4 float32 tensor `serve` publishes, over the TCP data plane."""
    request = weights_pb2.FetchSlicesRequest(sampler_id="sampler-0", version=0, tensors=[weights_pb2.TensorSlices(
        tensor_index=0, slices=[weights_pb2.SliceRange(start=[0, 0], stop=[3, 4])])])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(tcp_wire.encode_request(request.SerializeToString(), token))
        code, _ = tcp_wire.read_status(sock, time.monotonic() + 5)
        if code:
            return code, b""
        _, _, nbytes = tcp_wire.SLICE_HEADER.unpack(tcp_wire.recv_exact(sock, tcp_wire.SLICE_HEADER.size))
        return code, tcp_wire.recv_exact(sock, nbytes, time.monotonic() + 5)


def test_idle_data_plane_connections_hold_no_transfer_slot(tiny_parts, shared_redis, run_name, tmp_path):
    server, paths = limited(tiny_parts, shared_redis.url, run_name, tmp_path, data_plane=True)
    with server as stack:
        stack.tokens = paths
        data = stack.server.data
        idle = []
        try:
            # 300 connections that never finish asking: nothing sent, half a header, a token cut short, a
            # forged token followed by a request that never ends
            starts = [b"", tcp_wire.MAGIC[:2], tcp_wire.MAGIC + b"\x40\x00" + b"sampler",
                      tcp_wire.encode_request(b"x" * 100, "forged-token-forged-token")[:-50]]
            first_opened = time.monotonic()
            for i in range(300):
                sock = socket.create_connection(("127.0.0.1", data.port), timeout=5)
                sock.sendall(starts[i % len(starts)])
                idle.append(sock)
            for _ in range(3):  # several fetches in a row, each served while the idle connections stay
                code, raw = fetch_over_data_plane(data.port, stack.token("sampler-0"))
                assert code == 0 and len(raw) == 3 * 4 * 4
            wait_for(lambda: data.active_transfers == 0, 5, "no slot held once the fetches finished")
            # the forged token was answered UNAUTHENTICATED as soon as it arrived, before its request
            forged = idle[-1]
            assert tcp_wire.read_status(forged, time.monotonic() + 5)[0] == grpc.StatusCode.UNAUTHENTICATED.value[0]
            # at most 256 wait at once, the oldest closed first (before its 5 s deadline) ...
            assert data.waiting_connections <= 256
            assert idle[0].recv(1) == b"" and time.monotonic() - first_opened < data.request_timeout_s
            # ... and every one is closed at its deadline
            wait_for(lambda: data.waiting_connections == 0, 15, "the data plane to close connections that never asked")
        finally:
            for sock in idle:
                sock.close()
