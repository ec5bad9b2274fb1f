"""What a validated endpoint request holds while it waits for the engine: only the fields the endpoint reads. OpenAI
clients send fields it ignores (`user`, `metadata`, a message's own keys); a client's megabytes of them were held, as
20-30 times their size in Python objects, for as long as the request waited (up to sampler.openai.request_timeout_s),
by each of max_concurrent requests. A refused field is named with its value cut, never echoed whole; a body that is
no JSON object is told so in JSON's words."""

import gc
import json
import tracemalloc

import pytest

from grpo_stream.common.endpoint.app import _validated
from grpo_stream.common.endpoint.protocol import ChatRequest, CompletionRequest, RequestError

MIB = 1 << 20


def _held_after_validation(model, body: dict):
    """(the request, bytes of Python objects it holds once the parsed body is gone)."""
    text = json.dumps(body).encode()  # a ~4 MiB body, as the endpoint's limit lets through
    gc.collect()
    tracemalloc.start()
    try:
        request = model.model_validate(json.loads(text))
        gc.collect()
        return request, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()


def test_fields_the_endpoint_ignores_are_dropped_as_a_request_is_validated():
    junk = [{} for _ in range(1_300_000)]
    request, held = _held_after_validation(CompletionRequest, {
        "model": "m", "prompt": "hi", "user": junk, "grpo_rollout": "g", "min_tokens": 0,
        "stream_options": {"include_usage": True, "junk": [1, 2]}})
    assert held < MIB, f"a validated request holds {held / MIB:.0f} MiB of fields it ignores"
    assert request.model_extra == {"grpo_rollout": "g", "min_tokens": 0}  # read later: kept
    assert request.stream_options.include_usage and not request.stream_options.model_extra


def test_a_messages_own_keys_are_dropped_and_what_templates_read_is_kept():
    junk = [[] for _ in range(1_300_000)]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "junk": 1}, "junk": 2}
    request, held = _held_after_validation(ChatRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "junk": 3}], "junk": junk},
        {"role": "assistant", "content": None, "tool_calls": [call], "name": "a"},
        {"role": "tool", "content": "4", "tool_call_id": "c1"}]})
    assert held < MIB, f"a validated request holds {held / MIB:.0f} MiB of keys the templates never read"
    assert request.messages == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "name": "a",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"}]


@pytest.mark.parametrize("model, body, field", [
    (CompletionRequest, {"prompt": "hi", "stop_token_ids": list(range(100_000))}, "stop_token_ids"),
    (ChatRequest, {"messages": [{"role": "x" * 100_000, "content": "hi"}]}, "messages[0].role")])
def test_a_refused_fields_value_is_cut_in_its_message(model, body, field):
    with pytest.raises(RequestError) as refused:
        model.model_validate({"model": "m", **body}).check()
    assert str(refused.value).startswith(field + "=") and len(str(refused.value)) < 300


@pytest.mark.parametrize("body, sent", [(b"[]", "an array"), (b"", "null or nothing"), (b'"hi"', "a string")])
def test_a_body_that_is_no_json_object_is_told_so_without_pydantics_class_names(body, sent):
    answer = json.loads(_validated(CompletionRequest, body).body)["error"]
    assert answer["message"].startswith("the body: should be a JSON object") and answer["message"].endswith(sent)
    assert "CompletionRequest" not in answer["message"]
