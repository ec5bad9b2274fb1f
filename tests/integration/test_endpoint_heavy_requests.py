"""The sampler's OpenAI-compatible endpoint against heavy requests and a stopping sampler, over real HTTP on loopback
(the tiny Qwen-family chat model on the JAX engine, the endpoint's own uvicorn server).

- Reading a request (its JSON, its fields, its prompt) and writing its answer run off the event loop: a 4 MiB body of
  a million small lists held the loop for 4 s, every other client of the endpoint waiting.
- A request that comes once the sampler began to stop (between the queue's last answer and the server's stop) waited
  for an engine nobody would serve again, until uvicorn cancelled it: a bare 500 and a traceback per request. It is
  answered 503 with Retry-After, at once, in OpenAI's shape."""

import concurrent.futures
import contextlib
import threading

import httpx
import pytest

from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.endpoint import app as app_module
from grpo_stream.common.endpoint import generation
from grpo_stream.common.engine import continuous
from grpo_stream.common.rpc.auth import write_tokens
from grpo_stream.sampler_service.openai_server import openai_endpoint
from tests.chat_families import FamilyDirs
from tests.conftest import CONFIGS
from tests.support import endpoint_overrides

COMPLETION = ("/completions", {"model": "policy", "prompt": "Add 2 and 3.", "max_tokens": 2})
CHAT = ("/chat/completions", {"model": "policy", "messages": [{"role": "user", "content": "Add 2 and 3."}],
                              "max_tokens": 2})


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    pytest.importorskip("torch")  # the family's model and tokenizer files are written with them
    pytest.importorskip("transformers")
    tokens = write_tokens(tmp_path_factory.mktemp("auth"))
    cfg = load_config(CONFIGS / "tiny_arith.yaml", endpoint_overrides(
        FamilyDirs(tmp_path_factory.mktemp("families"))["qwen"], tokens["table"]))
    _, tok = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tok.vocab_size, seed=0)
    return cfg, continuous.build(cfg, model, tok), tok, model, {"Authorization": "Bearer " +
                                                                 tokens["client"].read_text().strip()}


@contextlib.contextmanager
def serving(parts):
    cfg, engine, tok, model, _ = parts
    with openai_endpoint(cfg, 0, "sampler-0", engine, tok, lambda: (model.params, 1), None) as endpoint:
        yield endpoint


@pytest.mark.parametrize("module, name, route", [(app_module, "_parse", COMPLETION),  # the body's JSON
                                                 (generation, "template_messages", CHAT),  # the request's checks
                                                 (generation, "cut_at_stop", COMPLETION)])  # its answer
def test_other_clients_are_answered_while_a_request_is_read_or_answered(parts, monkeypatch, module, name, route):
    """Each step is held (as a heavy request holds it) until another client has been answered."""
    real, entered, release = getattr(module, name), threading.Event(), threading.Event()

    def held(*args, **kwargs):
        entered.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, held)
    with serving(parts) as endpoint, concurrent.futures.ThreadPoolExecutor(1) as pool:
        heavy = pool.submit(httpx.post, endpoint.url + route[0], headers=parts[4], json=route[1], timeout=60)
        assert entered.wait(30), f"the request never reached {name}"
        try:  # on the event loop, the step held every other client (a ReadTimeout here)
            other = httpx.get(endpoint.url + "/models", headers=parts[4], timeout=10)
        finally:
            release.set()
        assert other.status_code == 200
        assert heavy.result().status_code == 200, heavy.result().text


def test_a_request_once_the_sampler_began_to_stop_is_a_503_with_retry_after(parts, monkeypatch):
    answers = []
    with serving(parts) as endpoint:
        fail_waiting = endpoint.queue.fail_waiting
        idle = next(t for t in endpoint._threads if t.name.endswith("openai-idle"))

        def then_a_request(why: str) -> None:
            fail_waiting(why)
            if answers:  # the context's own close, after this test's
                return
            idle.join(10)  # the idle serve has stopped too: no serve will take what comes now
            # the server still listens: a request coming now found its sequences waiting for no serve
            answers.append(httpx.post(endpoint.url + COMPLETION[0], headers=parts[4], json=COMPLETION[1],
                                      timeout=15))

        monkeypatch.setattr(endpoint.queue, "fail_waiting", then_a_request)
        endpoint.close()
    answer = answers[0]
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1", answer.text
    error = answer.json()["error"]
    assert error["type"] == "server_error" and "the sampler is stopping" in error["message"]
    assert not parts[1].side  # the engine is left without the endpoint's queue
