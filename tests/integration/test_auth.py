"""Every RPC of every service against every caller: no token, a wrong token, and each role. UNAUTHENTICATED and
PERMISSION_DENIED exactly where ROLES_BY_METHOD says; the TCP weights data plane checks the same; TLS and mutual
TLS with certificates made in the test."""

import socket
import ssl
import time

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2  # noqa: F401 - registers grpc.health.v1
from grpc_reflection.v1alpha import reflection_pb2  # noqa: F401 - registers the reflection service

from grpo_stream.common.weights import tcp_wire as weight_bulk
from grpo_stream.common.rpc.auth import ROLES, ROLES_BY_METHOD
from grpo_stream.protos import prompts_pb2, rollout_pb2, rollout_pb2_grpc, weights_pb2, weights_pb2_grpc
from tests.pki import make_pki
from tests.support import answer, serve, with_run_name

pytestmark = pytest.mark.redis
SERVICES = ("grpo_stream.v1.RolloutIngest", "grpo_stream.v1.WeightService", "grpo_stream.v1.PromptService",
            "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection")
REQUESTS = {  # a small request per method; an allowed caller gets past auth with it
    "StreamBatches": rollout_pb2.RolloutBatch(), "PushGroup": rollout_pb2.RolloutGroup(),
    "GetDataPosition": rollout_pb2.DataPositionRequest(sampler_id="sampler-0"),
    "ClaimPrompts": rollout_pb2.ClaimRequest(sampler_id="sampler-0"),
    "GetManifest": weights_pb2.GetManifestRequest(sampler_id="sampler-0"),
    "FetchSlices": weights_pb2.FetchSlicesRequest(sampler_id="s", version=99),
    "ReportVersion": weights_pb2.VersionReport(sampler_id="sampler-0"),
    "Submit": prompts_pb2.SubmitRequest(prompts=[prompts_pb2.PromptSpec(text="Q: 1 + 1 A:")]),
    "StreamResults": prompts_pb2.ResultsRequest(prompt_ids=["p-unknown"]),
    "Cancel": prompts_pb2.CancelRequest(prompt_ids=["p-unknown"]), "GetStatus": prompts_pb2.StatusRequest(),
}


def methods():
    out = []
    pool = descriptor_pool.Default()
    for name in SERVICES:
        for m in pool.FindServiceByName(name).methods:
            out.append((f"/{name}/{m.name}", m))
    return out


def call(channel, path: str, method) -> grpc.StatusCode:
    """The status of one call of `method` (the first message of a response stream)."""
    request = REQUESTS.get(method.name) or message_factory.GetMessageClass(method.input_type)()
    if method.name == "ServerReflectionInfo":
        request.list_services = ""
    if method.name == "Check":
        request.service = ""
    response = message_factory.GetMessageClass(method.output_type)
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    rpc = kind(path, request_serializer=lambda m: m.SerializeToString(), response_deserializer=response.FromString)
    arg = iter([request]) if method.client_streaming else request
    try:
        reply = rpc(arg, timeout=10)
        if method.server_streaming:
            next(iter(reply), None)
            reply.cancel()
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def test_every_rpc_states_its_roles():
    assert {path for path, _ in methods()} <= set(ROLES_BY_METHOD)
    assert all(roles and roles <= set(ROLES) for roles in ROLES_BY_METHOD.values())


@pytest.fixture(scope="module")
def stack(tiny_parts, shared_redis, new_run_name, tmp_path_factory):
    cfg, task, tokenizer, _ = tiny_parts
    with serve(with_run_name(cfg, new_run_name()), shared_redis.url, tmp_path_factory.mktemp("auth"), task, tokenizer,
               data_plane=True) as s:
        yield s


@pytest.mark.parametrize("caller", ["no token", "wrong token", *ROLES])
def test_auth_matrix(stack, caller):
    token = {"no token": None, "wrong token": "not-a-token-of-this-run"}.get(caller)
    channel = stack.channel(caller if caller in ROLES else None, token)
    outcomes = {}
    for path, method in methods():
        code = call(channel, path, method)
        if caller not in ROLES:
            expected = "UNAUTHENTICATED"
        elif caller in ROLES_BY_METHOD[path]:
            expected = "passes"
            code = "passes" if code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) \
                else code
        else:
            expected = "PERMISSION_DENIED"
        outcomes[path] = (expected, code if code == "passes" else code.name)
    wrong = {p: o for p, o in outcomes.items() if o[0] != o[1]}
    assert not wrong, wrong
    # the matrix is not vacuous: a client may submit but not push rollouts or fetch weights
    if caller == "client":
        assert outcomes["/grpo_stream.v1.RolloutIngest/PushGroup"][1] == "PERMISSION_DENIED"
        assert outcomes["/grpo_stream.v1.WeightService/FetchSlices"][1] == "PERMISSION_DENIED"
        assert outcomes["/grpo_stream.v1.PromptService/Submit"][1] == "passes"


def data_plane_status(stack, token, wrap=None) -> int:
    request = weights_pb2.FetchSlicesRequest(sampler_id="s", version=0, tensors=[weights_pb2.TensorSlices(
        tensor_index=0, slices=[weights_pb2.SliceRange(start=[0, 0], stop=[3, 4])])])
    sock = socket.create_connection(("127.0.0.1", stack.server.data.port), timeout=10)
    if wrap is not None:
        sock = wrap(sock)
    with sock:
        sock.sendall(weight_bulk.encode_request(request.SerializeToString(), token))
        return weight_bulk.read_status(sock, deadline=__import__("time").monotonic() + 10)[0]


def test_weights_data_plane_checks_tokens_like_fetch_slices(stack):
    assert data_plane_status(stack, None) == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert data_plane_status(stack, "forged-token-forged-token") == grpc.StatusCode.UNAUTHENTICATED.value[0]
    assert data_plane_status(stack, stack.token("client")) == grpc.StatusCode.PERMISSION_DENIED.value[0]
    assert data_plane_status(stack, stack.token("sampler")) == 0
    assert data_plane_status(stack, stack.token("admin")) == 0


def test_open_health_answers_probes_without_a_token_and_nothing_else(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    cfg = with_run_name(cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"open_health": True})}), run_name)
    with serve(cfg, shared_redis.url, tmp_path / "auth", task, tokenizer) as stack:
        channel = stack.channel(None)
        by_path = dict(methods())
        assert call(channel, "/grpc.health.v1.Health/Check", by_path["/grpc.health.v1.Health/Check"]) == \
            grpc.StatusCode.OK
        assert call(channel, "/grpo_stream.v1.PromptService/GetStatus",
                    by_path["/grpo_stream.v1.PromptService/GetStatus"]) == grpc.StatusCode.UNAUTHENTICATED
        # a Watch stream never ends: without a name nothing would bound how many one peer holds
        from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: PLC0415

        with pytest.raises(grpc.RpcError) as watch:
            next(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=5))
        assert watch.value.code() == grpc.StatusCode.UNAUTHENTICATED


def tls_cfg(cfg, pki, **client):
    tls = {"enabled": True, "cert_file": str(pki["server_cert"]), "key_file": str(pki["server_key"]),
           "ca_file": str(pki["ca"]), **client}
    return cfg.model_copy(update={"tls": cfg.tls.model_validate(tls)})


def status_code(stack, cfg) -> grpc.StatusCode:
    by_path = dict(methods())
    return call(stack.channel("client", cfg=cfg), "/grpo_stream.v1.PromptService/GetStatus",
                by_path["/grpo_stream.v1.PromptService/GetStatus"])


def test_tls_serves_clients_that_trust_the_ca_and_refuses_plaintext(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    pki = make_pki(tmp_path / "pki")
    server_cfg = with_run_name(tls_cfg(cfg, pki), run_name)
    with serve(server_cfg, shared_redis.url, tmp_path / "auth", task, tokenizer, data_plane=True) as stack:
        assert status_code(stack, server_cfg) == grpc.StatusCode.OK
        assert status_code(stack, cfg) == grpc.StatusCode.UNAVAILABLE  # plaintext client
        untrusting = tls_cfg(cfg, {**pki, "ca": pki["rogue_ca"]})
        assert status_code(stack, untrusting) == grpc.StatusCode.UNAVAILABLE
        # the data plane speaks TLS with the same certificate, and still checks the token
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        wrap = lambda s: context.wrap_socket(s, server_hostname="127.0.0.1")  # noqa: E731
        assert data_plane_status(stack, stack.token("sampler"), wrap) == 0
        assert data_plane_status(stack, stack.token("client"), wrap) == grpc.StatusCode.PERMISSION_DENIED.value[0]
        with pytest.raises((ConnectionError, OSError, weight_bulk.WeightTransferError)):
            data_plane_status(stack, stack.token("sampler"))  # plaintext to a TLS data plane


def test_mutual_tls_requires_a_client_certificate_from_the_ca(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    pki = make_pki(tmp_path / "pki")
    server_cfg = with_run_name(tls_cfg(cfg, pki, require_client_cert=True), run_name)
    with serve(server_cfg, shared_redis.url, tmp_path / "auth", task, tokenizer) as stack:
        with_cert = tls_cfg(cfg, pki, client_cert_file=str(pki["client_cert"]), client_key_file=str(pki["client_key"]))
        assert status_code(stack, with_cert) == grpc.StatusCode.OK
        assert status_code(stack, tls_cfg(cfg, pki)) == grpc.StatusCode.UNAVAILABLE  # no client certificate
        rogue = tls_cfg(cfg, pki, client_cert_file=str(pki["rogue_cert"]), client_key_file=str(pki["rogue_key"]))
        assert status_code(stack, rogue) == grpc.StatusCode.UNAVAILABLE


@pytest.fixture
def named_stack(tiny_parts, shared_redis, run_name, tmp_path):
    """A server whose table has per-sampler tokens (sampler-0, sampler-1) beside the shared sampler token, and a
    second client, alice, beside the default client."""
    from grpo_stream.common.rpc.auth import write_tokens  # noqa: PLC0415

    cfg, task, tokenizer, _ = tiny_parts
    paths = write_tokens(tmp_path / "table", samplers=2)
    paths["table"].write_text(paths["table"].read_text() + "- {name: alice, role: client, token: alice-token-0123456789}\n")
    cfg = with_run_name(cfg, run_name)
    cfg = cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"tokens_file": str(paths["table"])})})
    with serve(cfg, shared_redis.url, tmp_path / "unused", task, tokenizer) as stack:
        stack.tokens = paths
        yield stack


def dataset_group(run: str, sampler_id: str, position: int, id_of: str | None = None):
    from grpo_stream.common.rollouts.wire import CompletionData, GroupData, to_proto  # noqa: PLC0415

    comps = [CompletionData(np.array([5, 6, 7], np.int32), np.array([-0.1, -0.2, -0.3], np.float32), float(i), False)
             for i in range(4)]
    return to_proto(GroupData(f"{run}/{id_of or sampler_id}/{position}", f"q{position}", np.array([3, 4], np.int32),
                              comps, 0, sampler_id, data_position=position))


def test_a_sampler_token_speaks_only_for_its_own_sampler_id(named_stack):
    run = named_stack.cfg.run.name
    stub = lambda key: rollout_pb2_grpc.RolloutIngestStub(named_stack.channel(None, named_stack.token(key)))  # noqa
    weights = lambda key: weights_pb2_grpc.WeightServiceStub(named_stack.channel(None, named_stack.token(key)))  # noqa
    denied = {
        "push as another sampler": lambda: stub("sampler-1").PushGroup(dataset_group(run, "sampler-0", 1)),
        "another sampler's group id": lambda: stub("sampler-0").PushGroup(
            dataset_group(run, "sampler-0", 1, id_of="sampler-1")),
        "stream as another sampler": lambda: list(stub("sampler-1").StreamBatches(
            iter([rollout_pb2.RolloutBatch(groups=[dataset_group(run, "sampler-0", 2)])]))),
        "data position": lambda: stub("sampler-1").GetDataPosition(rollout_pb2.DataPositionRequest(
            sampler_id="sampler-0")),
        "claim": lambda: stub("sampler-1").ClaimPrompts(rollout_pb2.ClaimRequest(sampler_id="sampler-0")),
        "admit": lambda: stub("sampler-0").Admit(rollout_pb2.AdmitRequest(sampler_id="sampler-1", groups=1)),
        "report another sampler's weight version": lambda: weights("sampler-1").ReportVersion(
            weights_pb2.VersionReport(sampler_id="sampler-0", installed_version=0, groups_generated=99)),
        "ask for the manifest as another sampler": lambda: weights("sampler-1").GetManifest(
            weights_pb2.GetManifestRequest(sampler_id="sampler-0", installed_version=0)),
    }
    for what, attempt in denied.items():
        with pytest.raises(grpc.RpcError) as err:
            attempt()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
        assert "sampler_id" in err.value.details() or "group_id" in err.value.details(), what
    assert named_stack.buffer.counters()["ingested"] == 0  # nothing spoofed reached the buffer
    samplers = named_stack.publisher.samplers
    assert "sampler-0" not in samplers.installed and samplers.groups_generated() == 0
    weights("sampler-0").ReportVersion(weights_pb2.VersionReport(sampler_id="sampler-0", installed_version=0,
                                                                  groups_generated=3))
    assert samplers.installed["sampler-0"] == [0] and samplers.groups_generated() == 3
    # each sampler sends as itself; the shared token acts for every sampler-<k>; an admin for anyone
    assert stub("sampler-0").PushGroup(dataset_group(run, "sampler-0", 1)).code == 0
    assert stub("sampler").PushGroup(dataset_group(run, "sampler-1", 1)).code == 0
    assert stub("admin").PushGroup(dataset_group(run, "other", 1)).code == 0
    assert stub("sampler-1").GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id="sampler-1")).position == 1
    assert named_stack.buffer.ingested_by_sampler() == {"sampler-0": 1, "sampler-1": 1, "other": 1}


def test_a_client_follows_only_its_own_prompts_and_tags(named_stack):
    from grpo_stream.common.rpc.grpc_util import ClientSecurity  # noqa: PLC0415
    from grpo_stream.client.prompts import PromptClient  # noqa: PLC0415

    alice = PromptClient(named_stack.address, ClientSecurity("alice-token-0123456789"))
    bob = PromptClient(named_stack.address, ClientSecurity(named_stack.token("client")))
    admin = PromptClient(named_stack.address, ClientSecurity(named_stack.token("admin")))
    ids = alice.submit([{"text": "Q: 1 + 2 A:", "tags": ["alice-eval"]}])
    bob.submit([{"text": "Q: 2 + 2 A:", "tags": ["shared"]}])
    alice.submit([{"text": "Q: 3 + 2 A:", "tags": ["shared"]}])
    for attempt in (lambda: list(bob.results(tag="alice-eval", follow=False)),
                    lambda: list(bob.results(ids, timeout_s=5))):
        with pytest.raises(grpc.RpcError) as err:
            attempt()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "another client" in err.value.details() or "other clients" in err.value.details()
    # answer all three prompts (a sampler claims and pushes them), then follow by tag
    from grpo_stream.common.rollouts.wire import to_proto  # noqa: PLC0415

    sampler = rollout_pb2_grpc.RolloutIngestStub(named_stack.channel(None, named_stack.token("sampler-0")))
    claimed = sampler.ClaimPrompts(rollout_pb2.ClaimRequest(sampler_id="sampler-0", max_prompts=8)).prompts
    assert len(claimed) == 3
    for prompt in claimed:
        assert sampler.PushGroup(to_proto(answer(prompt, named_stack.cfg.run.name, "sampler-0"))).code == 0
    texts = lambda results: sorted(r.prompt_text for r in results)  # noqa: E731
    assert texts(alice.results(tag="alice-eval", follow=False)) == ["Q: 1 + 2 A:"]
    # a tag both use: each follows only the prompts it submitted, an admin all of them
    assert texts(bob.results(tag="shared", follow=False)) == ["Q: 2 + 2 A:"]
    assert texts(alice.results(tag="shared", follow=False)) == ["Q: 3 + 2 A:"]
    assert texts(admin.results(tag="shared", follow=False)) == ["Q: 2 + 2 A:", "Q: 3 + 2 A:"]
    assert [r.prompt_id for r in admin.results(ids, timeout_s=10)] == ids


def test_plaintext_beyond_loopback_is_warned_about_or_refused(tiny_parts, shared_redis, run_name, tmp_path, caplog):
    import dataclasses  # noqa: PLC0415

    from grpo_stream.common.rpc.grpc_util import ServerSecurity, is_loopback  # noqa: PLC0415
    from grpo_stream.trainer_service.server import TrainerServer  # noqa: PLC0415
    from grpo_stream.trainer_service.publication.publisher import WeightPublisher  # noqa: PLC0415

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.1.2.3")
    cfg, *_ = tiny_parts
    security = ServerSecurity.from_config(with_run_name(cfg, run_name).model_copy(update={"auth": cfg.auth.model_copy(
        update={"mode": "none"})}))
    quiet = TrainerServer(None, WeightPublisher(), "127.0.0.1", 0, security=security)
    with caplog.at_level("WARNING"):
        quiet.start()
        quiet.stop(0)
        assert "plaintext" not in caplog.text
        loud = TrainerServer(None, WeightPublisher(), "0.0.0.0", 0, security=security)
        loud.start()
        loud.stop(0)
    assert "trainer.port listens on 0.0.0.0 without TLS" in caplog.text
    strict = dataclasses.replace(security, plaintext_bind="refuse")
    with pytest.raises(OSError, match="tls.plaintext_bind"):
        TrainerServer(None, WeightPublisher(), "0.0.0.0", 0, security=strict).start()


def test_a_sampler_refused_for_its_ids_stops_sending_with_the_reason(named_stack):
    from grpo_stream.common.rpc.grpc_util import ClientSecurity, open_channel  # noqa: PLC0415
    from grpo_stream.sampler_service.rollout_client import RolloutClient  # noqa: PLC0415

    channel = open_channel(named_stack.address, ClientSecurity(named_stack.token("sampler-1")))
    client = RolloutClient(channel, backlog_max_groups=4).start()
    try:
        client.put(dataset_group(named_stack.cfg.run.name, "sampler-0", 1), timeout_s=5)  # another sampler's group
        deadline = time.monotonic() + 20
        while client.refused is None:
            assert time.monotonic() < deadline, "the client kept retrying a refusal"
            time.sleep(0.02)
        with pytest.raises(PermissionError, match="PERMISSION_DENIED.*sampler_id"):
            client.put(dataset_group(named_stack.cfg.run.name, "sampler-1", 2), timeout_s=1)
    finally:
        client.close()
        channel.close()
