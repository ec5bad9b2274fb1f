"""`stream: true` answers of the OpenAI-compatible endpoint: a finished `chat.completion` or `text_completion` answer
(generation.py) sent as OpenAI's server-sent events, so clients that stream (agent frameworks, chat front ends, the
openai SDK's `stream=True`) are served.

The engine answers a request's sequences whole, so the events come once its choices are done: per choice, chat sends
a first chunk with the role, one with the content (and its logprobs, tool calls, token ids), and one with its
`finish_reason`; a text completion one chunk with the text and one with the `finish_reason`. With
`stream_options.include_usage` every chunk carries `usage: null` and a last chunk with no choices carries the usage,
as OpenAI's do; the stream ends with `data: [DONE]`. A client that leaves while its choices are generated is treated
as any other (app.py): its sequences are withdrawn.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

# a choice's fields sent with its content (vLLM's extensions beside OpenAI's), never in the finish chunk
_CHAT_EXTRA = ("token_ids", "policy_version")
_TEXT_EXTRA = ("token_ids", "prompt_token_ids", "policy_version")


# characters Python's str.splitlines (and readers built on it: httpx's iter_lines, httpx-sse before 0.4.1) end a line
# at, which JSON leaves unescaped: written raw, a model's U+2028 split its event's `data:` line in two for them
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"})


def _event(data: dict[str, Any]) -> str:
    # NaN refused, as the answer's JSON refuses it: -Infinity is no JSON (the openai SDK fails on the event)
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    return f"data: {text.translate(_LINE_BREAKS)}\n\n"


def _chat_chunks(choice: dict[str, Any]) -> Iterator[dict[str, Any]]:
    message = choice["message"]
    yield {"index": choice["index"], "delta": {"role": "assistant", "content": ""}, "logprobs": None,
           "finish_reason": None}
    delta: dict[str, Any] = {"content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
    yield {"index": choice["index"], "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None,
           **{k: choice[k] for k in _CHAT_EXTRA if k in choice}}
    yield {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}


def _text_chunks(choice: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield {"index": choice["index"], "text": choice["text"], "logprobs": choice.get("logprobs"),
           "finish_reason": None, **{k: choice[k] for k in _TEXT_EXTRA if k in choice}}
    yield {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}


def sse_events(answer: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """`answer` (a chat.completion or text_completion object) as the `data:` events of its stream."""
    chat = answer["object"] == "chat.completion"
    head = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"],
            "system_fingerprint": answer["system_fingerprint"]}
    if include_usage:
        head["usage"] = None
    first = True
    for choice in answer["choices"]:
        for chunk in (_chat_chunks if chat else _text_chunks)(choice):
            data = {**head, "choices": [chunk]}
            if first and "prompt_token_ids" in answer:  # chat's: once, at the top of the first chunk (as vLLM)
                data["prompt_token_ids"] = answer["prompt_token_ids"]
            first = False
            yield _event(data)
    if include_usage:
        yield _event({**head, "choices": [], "usage": answer["usage"]})
    yield "data: [DONE]\n\n"
