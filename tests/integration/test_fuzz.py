"""Fuzzing every public RPC on a real server (real Redis, auth on, admin token so requests reach the handlers):
400 generated requests per RPC in the default lane (1,000 until stop 76), 5,000 with `-m fuzz` (the deep lane),
each either a structured message with arbitrary, empty, oversized and
out-of-range field values, strings that are not UTF-8 (built with the string-as-bytes twin of the message), or
random bytes. No call may end in UNKNOWN or INTERNAL (an exception in a handler, or a request the server could not
explain), and afterwards the health check still says SERVING and a normal request still works.

Then half-sent calls: hundreds of calls (200 in the default lane, 1,000 in the deep one) of every kind, without a
token, with the wrong role, with a client's and with another sampler's token, that send their headers and never
their request (plus raw HTTP/2 requests cut short); a sampler's admission, rollouts, manifest and weight fetches
are served throughout (common/rpc/call_guard.py)."""

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.client.prompts import PromptClient
from grpo_stream.trainer_service.ingest.proto_decode import _twin_pool
from grpo_stream.protos import prompts_pb2, rollout_pb2, weights_pb2  # noqa: F401 - registers the services
from tests.support import serve, wait_for, with_run_name

pytestmark = [pytest.mark.redis, pytest.mark.slow]
# requests per RPC: the default lane, and the deep lane that `python -m pytest -m fuzz` runs (pyproject's addopts
# leave it out of a plain `pytest`)
DEPTHS = [pytest.param(400, id="400"), pytest.param(5000, id="5k", marks=pytest.mark.fuzz)]
FORBIDDEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAUTHENTICATED,
             grpc.StatusCode.UNIMPLEMENTED}
SERVICES = ("grpo_stream.v1.RolloutIngest", "grpo_stream.v1.WeightService", "grpo_stream.v1.PromptService")
METHODS = [(f"/{name}/{m.name}", m) for name in SERVICES
           for m in descriptor_pool.Default().FindServiceByName(name).methods]

_INT_RANGES = {FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
               FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1), FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1)}
_EDGE_INTS = st.sampled_from([0, 1, -1, 2, 7, 8, 9, 64, 65, 255, 256, 4096, 2**31 - 1, -(2**31)])
_TEXT = st.one_of(st.just(""), st.text(max_size=40), st.sampled_from(["Q: 1 + 1 A:", "probe", "sampler-0", "42"]),
                  st.text(min_size=4, max_size=4).map(lambda t: t * 10_000))  # oversized: 40k characters
_SHORT = st.one_of(st.text(max_size=8).map(str.encode), st.just(b"\xff"))
_BYTES_AS_STRING = st.one_of(_TEXT.map(str.encode), st.binary(max_size=40),
                             st.sampled_from([b"\xff\xfe", b"ab\xc3", b"\xed\xa0\x80"]))  # not UTF-8


def scalar(field: FieldDescriptor, original: FieldDescriptor):
    t = original.type
    if t == FieldDescriptor.TYPE_STRING:
        return _BYTES_AS_STRING
    if t == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.binary(min_size=1, max_size=8).map(lambda b: b * 4096))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(width=32 if t == FieldDescriptor.TYPE_FLOAT else 64)
    lo, hi = _INT_RANGES.get(t, (-(2**31), 2**31 - 1))
    return st.one_of(_EDGE_INTS.filter(lambda v: lo <= v <= hi), st.integers(lo, hi))


def message(twin_desc, original_desc, depth: int = 0):
    """A strategy for the twin message (string fields as bytes) of `original_desc`."""
    cls = message_factory.GetMessageClass(twin_desc)
    fields = {}
    for field in twin_desc.fields:
        original = original_desc.fields_by_name[field.name]
        if field.message_type is not None:
            if depth >= 2:
                continue
            value = message(field.message_type, original.message_type, depth + 1)
        else:
            value = scalar(field, original)
        # oversized lists repeat one scalar (hundreds of distinct or large nested messages are slow to make, use
        # gigabytes across examples, and find nothing more than a few do)
        if field.message_type is None:  # many short values: long lists of long strings only eat memory
            short = _SHORT if original.type == FieldDescriptor.TYPE_STRING else value
            many = st.lists(value, max_size=3) | short.map(lambda v: [v] * 300)
        else:
            many = st.lists(value, max_size=3 if depth == 0 else 2)
        fields[field.name] = st.none() | (many if field.is_repeated else value)

    def build(values):
        msg = cls()
        for name, value in values.items():
            if value is None:
                continue
            target = getattr(msg, name)
            if isinstance(value, list):
                if value and hasattr(value[0], "SerializeToString"):
                    for v in value:
                        target.add().CopyFrom(v)
                else:
                    target.extend(value)
            elif hasattr(value, "SerializeToString"):
                target.CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg
    return st.fixed_dictionaries(fields).map(build)


# Submit also gets plausible requests, so that some pass validation and reach the queue
_SPEC = st.builds(lambda text, q, answer, n, priority, tags, train: prompts_pb2.PromptSpec(
    **({"question": text} if q else {"text": text}), reference_answer=answer, num_generations=n, priority=priority,
    tags=tags, train=train), st.text("Q: 0123456789+=? A", min_size=0, max_size=30), st.booleans(),
    st.sampled_from(["", "4", "x"]), st.integers(-2, 70), st.integers(-2, 12),
    st.lists(st.sampled_from(["probe", "a b", "t" * 65, "ok:1"]), max_size=3), st.booleans())
PLAUSIBLE = {"Submit": st.lists(_SPEC, min_size=0, max_size=4).map(
    lambda specs: prompts_pb2.SubmitRequest(prompts=specs).SerializeToString())}


def request_bytes(method):
    original = method.input_type
    twin = _twin_pool(original.file.name).FindMessageTypeByName(original.full_name)
    options = [message(twin, original).map(lambda m: m.SerializeToString()), st.binary(max_size=200)]
    if method.name in PLAUSIBLE:
        options.append(PLAUSIBLE[method.name])
    return st.one_of(options)


@pytest.fixture(scope="module")
def stack(tiny_parts, shared_redis, new_run_name, tmp_path_factory):
    import logging

    cfg, task, tokenizer, _ = tiny_parts
    # tens of thousands of refused requests are expected here; their warnings would fill pytest's log capture
    quiet = [logging.getLogger(name) for name in ("trainer_service", "common")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        with serve(with_run_name(cfg, new_run_name()), shared_redis.url, tmp_path_factory.mktemp("fuzz"), task,
                   tokenizer) as s:
            yield s
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)


@pytest.mark.parametrize("examples", DEPTHS)
@pytest.mark.parametrize("path, method", METHODS, ids=[p for p, _ in METHODS])
def test_fuzzed_requests_never_crash_a_service(stack, path, method, examples):
    channel = stack.channel("admin")
    kind = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}[
        (method.client_streaming, method.server_streaming)]
    rpc = kind(path, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    seen: dict[str, int] = {}

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(requests=st.lists(request_bytes(method), min_size=1, max_size=3 if method.client_streaming else 1))
    def one(requests):
        try:
            reply = rpc(iter(requests) if method.client_streaming else requests[0], timeout=0.2 if
                        method.server_streaming else 10)
            if method.server_streaming:
                for _ in zip(range(3), reply):
                    pass
                reply.cancel()
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
            assert code not in FORBIDDEN, f"{path}: {code.name}: {exc.details()}"
        seen[code.name] = seen.get(code.name, 0) + 1

    one()
    assert sum(seen.values()) >= examples
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
    # ... and a normal request still works
    with PromptClient(stack.address, ClientSecurity(stack.token("admin"))) as client:
        assert client.status().run_name == stack.cfg.run.name
    print(f"{path}: {seen}")


# Half-sent calls: a peer opens calls and never finishes sending them. Before call_guard.py a unary call's server
# thread waited for its request with no deadline, so a few dozen such calls without any token stopped a server.
_INGEST, _WEIGHTS, _PROMPTS = "/grpo_stream.v1.RolloutIngest/", "/grpo_stream.v1.WeightService/", \
    "/grpo_stream.v1.PromptService/"
# (what, method, token, response stream, what the server may answer besides holding the call)
HOSTILE = [
    ("no token", _INGEST + "Admit", None, False, {"UNAUTHENTICATED"}),
    ("no token", _INGEST + "PushGroup", None, False, {"UNAUTHENTICATED"}),
    ("no token", _WEIGHTS + "GetManifest", None, False, {"UNAUTHENTICATED"}),
    ("no token", _PROMPTS + "Submit", None, False, {"UNAUTHENTICATED"}),
    ("no token", "/grpc.health.v1.Health/Check", None, False, {"UNAUTHENTICATED"}),
    ("no token", _WEIGHTS + "FetchSlices", None, True, {"UNAUTHENTICATED"}),
    ("no token", _PROMPTS + "StreamResults", None, True, {"UNAUTHENTICATED"}),
    ("no token", _INGEST + "StreamBatches", None, True, {"UNAUTHENTICATED"}),
    ("client token, sampler RPC", _INGEST + "Admit", "client", False, {"PERMISSION_DENIED"}),
    ("client token, sampler RPC", _INGEST + "StreamBatches", "client", True, {"PERMISSION_DENIED"}),
    ("client token", _PROMPTS + "Submit", "client", False, {"RESOURCE_EXHAUSTED"}),
    ("client token", _PROMPTS + "GetStatus", "client", False, {"RESOURCE_EXHAUSTED"}),
    ("client token", _PROMPTS + "StreamResults", "client", True, {"RESOURCE_EXHAUSTED"}),
    ("another sampler's token", _INGEST + "Admit", "sampler-1", False, {"RESOURCE_EXHAUSTED"}),
    ("another sampler's token", _INGEST + "PushGroup", "sampler-1", False, {"RESOURCE_EXHAUSTED"}),
    ("another sampler's token", _WEIGHTS + "GetManifest", "sampler-1", False, {"RESOURCE_EXHAUSTED"}),
    ("another sampler's token", _WEIGHTS + "FetchSlices", "sampler-1", True, {"RESOURCE_EXHAUSTED"}),
    ("another sampler's token", _INGEST + "StreamBatches", "sampler-1", True, {"RESOURCE_EXHAUSTED"}),
]
HALF_SENT = [pytest.param(200, id="200"), pytest.param(1000, id="1000", marks=pytest.mark.fuzz)]


def serve_a_sampler(stack, position: int) -> None:
    """What a sampler does, each call within 10 s: admission, a batch of two real groups over StreamBatches (each
    acknowledged as stored), the manifest, and the bytes of the weights."""
    import numpy as np  # noqa: PLC0415

    from grpo_stream.common.rollouts.wire import CompletionData, GroupData, to_proto  # noqa: PLC0415
    from grpo_stream.protos import rollout_pb2_grpc, weights_pb2_grpc  # noqa: PLC0415

    channel = stack.channel(None, stack.token("sampler-0"))
    ingest, weights = rollout_pb2_grpc.RolloutIngestStub(channel), weights_pb2_grpc.WeightServiceStub(channel)
    run = stack.cfg.run.name
    ingest.Admit(rollout_pb2.AdmitRequest(sampler_id="sampler-0", groups=2, policy_version=0), timeout=10)
    groups = [to_proto(GroupData(f"{run}/sampler-0/{p}", f"q{p}", np.array([3, 4], np.int32), [CompletionData(
        np.array([5, 6, 7], np.int32), np.array([-0.1, -0.2, -0.3], np.float32), float(i), False) for i in range(4)],
        0, "sampler-0", data_position=p)) for p in (position, position + 1)]
    acks = [a for reply in ingest.StreamBatches(iter([rollout_pb2.RolloutBatch(groups=groups)]), timeout=10)
            for a in reply.acks]
    assert [a.code for a in acks] == [0, 0], acks
    manifest = weights.GetManifest(weights_pb2.GetManifestRequest(sampler_id="sampler-0", installed_version=-1),
                                   timeout=10)
    assert manifest.version == 0
    chunks = list(weights.FetchSlices(weights_pb2.FetchSlicesRequest(sampler_id="sampler-0", version=0, tensors=[
        weights_pb2.TensorSlices(tensor_index=0, slices=[weights_pb2.SliceRange(start=[0, 0], stop=[3, 4])])]),
        timeout=10))
    assert sum(len(c.data) for c in chunks) == 3 * 4 * 4  # the float32 3x4 tensor `serve` publishes


@pytest.mark.parametrize("hostile_calls", HALF_SENT)
def test_a_sampler_is_served_while_hundreds_of_calls_hang_half_sent(per_sampler_stack, hostile_calls):
    from grpo_stream.common.rpc.call_guard import CallLimits, kind_of  # noqa: PLC0415
    from tests.half_sent import HalfSentCalls, PartialBodies  # noqa: PLC0415

    stack = per_sampler_stack
    host, port = stack.address.rsplit(":", 1)
    calls, raw = HalfSentCalls(stack.address), []
    try:
        for i in range(hostile_calls):
            what, path, key, streaming, _ = HOSTILE[i % len(HOSTILE)]
            calls.open(what, path, key and stack.token(key), streaming)
        # requests that announce 1,000 bytes and send 9, without and with a token
        raw = [PartialBodies(host, int(port), _INGEST + "Admit", token, 40)
               for token in (None, stack.token("sampler-1"))]
        assert len(calls.calls) >= hostile_calls
        serve_a_sampler(stack, 1)  # while the calls arrive
        # every call without a token or with the wrong role refused; of the others, each caller's share of each
        # kind held (rpc.calls_per_caller, at most half the kind), the rest refused
        attempts = {("sampler-1", "sampler"): 40}  # the partial requests with a token
        for what, path, key, *_ in (HOSTILE[i % len(HOSTILE)] for i in range(hostile_calls)):
            if key is not None and what != "client token, sampler RPC":
                attempts[key, kind_of(path)] = attempts.get((key, kind_of(path)), 0) + 1
        limits = CallLimits.from_config(stack.cfg)  # a caller's share: calls_per_caller, at most half its kind
        expected_held = sum(min(n, limits.caller_share(kind)) for (_, kind), n in attempts.items())

        def settled():
            held = calls.outcomes()
            return (held["no token"].get("open", 0) == held["client token, sampler RPC"].get("open", 0) == 0
                    and raw[0].outcome()["open"] == 0
                    and calls.still_open() + raw[1].outcome()["open"] == expected_held and held)
        held = wait_for(settled, 20, f"the server to refuse what it must and hold {expected_held} calls")
        for what, *_, allowed in HOSTILE:
            assert set(held[what]) <= allowed | {"open"}, (what, held[what])
        serve_a_sampler(stack, 3)  # ... and while the rest stay open
        assert calls.still_open() + raw[1].outcome()["open"] == expected_held
        print(f"{hostile_calls} half-sent calls + 80 partial requests: {held}; raw: {[r.outcome() for r in raw]}")
    finally:
        calls.close()
        for r in raw:
            r.close()
    health = health_pb2_grpc.HealthStub(stack.channel("admin"))
    assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
