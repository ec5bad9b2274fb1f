"""What reaches a streaming client's reader, and what a client's null means.

A streamed answer is read line by line; readers built on Python's str.splitlines (httpx's `iter_lines`, httpx-sse
before 0.4.1) end a line at U+2028, U+2029 and U+0085 too, which JSON leaves unescaped, so a model's U+2028 split an
event's `data:` line and the client failed on half a JSON object. OpenAI's API takes null for `n`, `stream`,
`logprobs`, `echo` as their default, and the openai SDK sends null for an argument passed as None: such a request was
refused 400 ("n: Input should be a valid integer").
"""

import json

import httpx
import pytest
from fastapi.responses import JSONResponse

from grpo_stream.common.endpoint.app import _validated
from grpo_stream.common.endpoint.protocol import ChatRequest, CompletionRequest
from grpo_stream.common.endpoint.streaming import sse_events

TEXT = "line\u2028sep\u2029par\x85nel\x1cfs\nnl \u00e9\u4e2d"


def _chat_answer(text: str) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "policy", "system_fingerprint": "f",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop",
                         "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}


def test_unicode_line_breaks_in_the_text_keep_each_event_on_one_line_for_splitlines_readers():
    stream = "".join(sse_events(_chat_answer(TEXT), include_usage=True))
    events = [line for line in httpx.Response(200, content=stream.encode()).iter_lines() if line]
    assert all(line.startswith("data: ") for line in events), events
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == TEXT
    assert chunks[-1]["usage"]["total_tokens"] == 7


@pytest.mark.parametrize("model, body, defaults", [
    (ChatRequest, {"messages": [{"role": "user", "content": "hi"}]},
     {"n": 1, "stream": False, "logprobs": False, "return_token_ids": False}),
    (CompletionRequest, {"prompt": "hi"},
     {"n": 1, "stream": False, "echo": False, "add_special_tokens": True, "logprobs": None}),
])
def test_null_for_a_field_openai_makes_nullable_is_its_default(model, body, defaults):
    request = _validated(model, json.dumps({"model": "policy", **body, **dict.fromkeys(defaults)}).encode())
    assert isinstance(request, model), request.body if isinstance(request, JSONResponse) else request
    assert {name: getattr(request, name) for name in defaults} == defaults


@pytest.mark.parametrize("n", [True, "2", 0])
def test_n_that_is_no_count_is_still_refused_naming_it(n):
    refused = _validated(CompletionRequest, json.dumps({"model": "policy", "prompt": "hi", "n": n}).encode())
    assert isinstance(refused, JSONResponse) and refused.status_code == 400
    assert json.loads(refused.body)["error"]["param"] == "n"
