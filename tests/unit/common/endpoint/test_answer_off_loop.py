"""An answer's JSON is written off the endpoint's event loop.

The answer object is built in a worker thread (generation.py), but it was then written to JSON on the event loop: n=64
choices of 4,096 tokens with logprobs is ~20 MB of JSON and about a second of the loop, during which no other client
of the endpoint is read or answered (their head and body deadlines run on). Checked by where json.dumps runs, not by
a timing."""

import asyncio
import json

import httpx

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.endpoint import app as endpoint_app

ANSWER = {"id": "cmpl-off-loop", "object": "text_completion", "created": 1, "model": "m", "system_fingerprint": "f",
          "choices": [{"index": 0, "text": "\u00e9 ok", "finish_reason": "stop", "logprobs": None}],
          "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}


class _Core:
    model_name, context_tokens, timeout_s = "m", 64, 5.0

    async def completion(self, request, caller):
        return ANSWER


def test_the_answers_json_is_written_off_the_event_loop(monkeypatch):
    written_on_loop = []
    dumps = json.dumps

    def spy(obj, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("id") == ANSWER["id"]:
            try:
                asyncio.get_running_loop()
                written_on_loop.append(True)
            except RuntimeError:  # no loop runs in this thread: a worker's
                written_on_loop.append(False)
        return dumps(obj, *args, **kwargs)

    monkeypatch.setattr(json, "dumps", spy)
    settings = load_config(None, []).sampler.openai
    app = endpoint_app.build_app(_Core(), None, settings, "token")

    async def call():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://endpoint") as client:
            return await client.post("/v1/completions", json={"model": "m", "prompt": "hi"},
                                     headers={"authorization": "Bearer token"})

    reply = asyncio.run(call())
    app.state.parser.shutdown(wait=False)
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert reply.json() == ANSWER  # the same JSON as before: UTF-8, not ASCII-escaped
    assert "\u00e9" in reply.content.decode("utf-8")
    assert written_on_loop == [False], "the answer was written to JSON on the event loop"
