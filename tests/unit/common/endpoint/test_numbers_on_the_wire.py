"""Numbers in what a client sends and in what the endpoint answers.

pydantic's lax mode read JSON's `true` as 1 for a numeric field (`"seed": true` was seed 1, `"logprobs": false` of a
text completion was logprobs 0, which turns the logprobs on); Python's json module reads NaN, Infinity and -Infinity
(and 1e400, as inf), which are no JSON, and `"temperature": Infinity` reached the engine's checks. A logprob of -inf
(a token the policy gives probability 0 at its temperature) was written -Infinity, which no JSON parser (the openai
SDK's included) reads: the non-streamed answer failed as a 500, the streamed one went out as events no client reads.
"""

import asyncio
import json
import math

import httpx
import pytest
from fastapi.responses import JSONResponse

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.endpoint import app as endpoint_app
from grpo_stream.common.endpoint.app import _validated
from grpo_stream.common.endpoint.generation import LOGPROB_FLOOR, EndpointCore
from grpo_stream.common.endpoint.protocol import ChatRequest, CompletionRequest, RequestError
from grpo_stream.common.endpoint.streaming import sse_events
from grpo_stream.common.engine.side_requests import SideRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}


def _refusal(model, base: dict, raw: str) -> dict:
    """The error of a body of `base` with `raw` (JSON text, or what Python's json reads) added."""
    body = (json.dumps(base)[:-1] + ", " + raw + "}").encode()
    answer = _validated(model, body)
    assert isinstance(answer, JSONResponse), f"{raw} was accepted"
    assert answer.status_code == 400
    return json.loads(answer.body)["error"]


@pytest.mark.parametrize("model, base, field", [
    *[(ChatRequest, CHAT, f) for f in ("seed", "temperature", "top_p", "top_logprobs", "n", "max_tokens",
                                       "max_completion_tokens")],
    *[(CompletionRequest, TEXT, f) for f in ("seed", "temperature", "top_p", "logprobs", "best_of", "max_tokens")]])
@pytest.mark.parametrize("value", ["true", "false"])
def test_a_boolean_for_a_numeric_field_is_refused_naming_it(model, base, field, value):
    error = _refusal(model, base, f'"{field}": {value}')
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: ") and "number" in error["message"] and value in error["message"]


@pytest.mark.parametrize("fields", [{"temperature": 1, "top_p": 1}, {"temperature": 0}, {"temperature": 0.7},
                                    {"seed": 0, "n": 2, "max_tokens": 3}])
def test_integers_where_numbers_are_expected_are_served(fields):
    for model, base in ((ChatRequest, CHAT), (CompletionRequest, TEXT)):
        request = _validated(model, json.dumps({**base, **fields}).encode())
        assert isinstance(request, model), request.body
        assert {name: getattr(request, name) for name in fields} == fields


@pytest.mark.parametrize("raw, field", [
    ('"temperature": NaN', "temperature"), ('"temperature": Infinity', "temperature"),
    ('"temperature": -Infinity', "temperature"), ('"temperature": 1e400', "temperature"),
    ('"top_p": NaN', "top_p"), ('"seed": Infinity', "seed"), ('"max_tokens": -Infinity', "max_tokens"),
    ('"presence_penalty": NaN', "presence_penalty"), ('"metadata": {"a": [1, NaN]}', "metadata.a[1]"),
    ('"tools": [{"type": "function", "function": {"name": "f", "parameters": {"default": Infinity}}}]',
     "tools[0].function.parameters.default")])
def test_a_non_finite_number_is_refused_naming_its_field(raw, field):
    for model, base in ((ChatRequest, CHAT), (CompletionRequest, TEXT)):
        error = _refusal(model, base, raw)
        assert error["param"] == field and error["message"].startswith(f"{field}: ")
        assert "finite" in error["message"], error["message"]


@pytest.mark.parametrize("extra", [{"min_tokens": False}, {"ignore_eos": 0}])
def test_a_neutral_extension_of_the_wrong_type_is_refused(extra):
    with pytest.raises(RequestError) as refused:
        ChatRequest.model_validate({**CHAT, **extra}).check()
    assert str(refused.value).startswith(f"{next(iter(extra))}=")


class _Tokenizer:
    def decode(self, ids):
        return "".join(chr(97 + i) for i in ids)

    def token_bytes(self, token):
        return bytes([97 + token])


def _core_with_sequence() -> tuple[EndpointCore, SideRequest]:
    core = EndpointCore.__new__(EndpointCore)
    core.tokenizer = _Tokenizer()
    seq = SideRequest(ids=[0], budget=4, key=None, tokens=[1, 2, 3, 4],
                      logprobs=[-0.5, float("-inf"), -1e6, float("nan")])
    return core, seq


def test_logprobs_the_engine_gives_as_not_finite_or_below_the_floor_are_answered_at_the_floor():
    core, seq = _core_with_sequence()
    chat = [entry["logprob"] for entry in core._chat_logprobs(seq, 4, False)]
    text = core._completion_logprobs(seq, 4)["token_logprobs"]
    assert chat == text == [-0.5, LOGPROB_FLOOR, LOGPROB_FLOOR, LOGPROB_FLOOR]
    assert all(math.isfinite(x) for x in chat) and LOGPROB_FLOOR == -9999.0


def _answer(logprob: float) -> dict:
    return {"id": "cmpl-nf", "object": "text_completion", "created": 1, "model": "m", "system_fingerprint": "f",
            "choices": [{"index": 0, "text": "a", "finish_reason": "stop",
                         "logprobs": {"tokens": ["a"], "token_logprobs": [logprob], "top_logprobs": None,
                                      "text_offset": [0]}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def test_a_stream_never_writes_a_number_json_has_not():
    with pytest.raises(ValueError):
        list(sse_events(_answer(float("-inf")), include_usage=False))


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_holding_a_non_finite_number_is_a_500_in_openais_shape_streamed_or_not(stream):
    class Core:
        model_name, context_tokens, timeout_s = "m", 64, 5.0

        async def completion(self, request, caller):
            return _answer(float("-inf"))

    app = endpoint_app.build_app(Core(), None, load_config(None, []).sampler.openai, "token")
    transport = httpx.ASGITransport(app=app)

    async def call():
        async with httpx.AsyncClient(transport=transport, base_url="http://endpoint") as client:
            return await client.post("/v1/completions", json={**TEXT, "stream": stream},
                                     headers={"authorization": "Bearer token"})

    try:
        reply = asyncio.run(call())
    finally:
        app.state.parser.shutdown(wait=False)
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"
    assert b"Infinity" not in reply.content
