"""The sampler's OpenAI-compatible endpoint over real HTTP, called with the real `openai` client: a tiny Qwen-family
chat model (tests/chat_families.py) on the JAX engine, the endpoint's uvicorn server on loopback, bearer tokens.

What a user relies on: a seeded chat or text completion returns exactly the engine's own generation for that seed
(text, token ids, logprobs); a conversation continued over the endpoint keeps the model's sampled ids (no
re-tokenization); tool calls come back as `tool_calls`; what the endpoint cannot serve is refused naming the field;
a call without a token, or with a sampler's, is refused; requests share the engine with the sampler's own batches.
"""

import concurrent.futures
import threading
import time
import types

import httpx
import jax
import numpy as np
import openai
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.engine import continuous
from grpo_stream.common.episodes.result import GroupWork
from grpo_stream.common.episodes.single_turn import SingleTurn
from grpo_stream.common.episodes.stream import RolloutStream
from grpo_stream.common.rpc.auth import write_tokens
from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.sampler_service.openai_server import openai_endpoint
from tests.chat_families import chat_family_dirs  # noqa: F401 - a fixture
from tests.conftest import CONFIGS

P, C, VERSION = 96, 24, 3


@pytest.fixture(scope="module")
def served(chat_family_dirs, tmp_path_factory):  # noqa: F811
    tokens = write_tokens(tmp_path_factory.mktemp("auth"))
    cfg = load_config(CONFIGS / "tiny_arith.yaml", [
        "model.kind=hf", f"model.path={chat_family_dirs['qwen']}", "model.dtype=float32",
        f"generation.max_prompt_tokens={P}", f"generation.max_new_tokens={C}", "generation.temperature=0.9",
        "generation.decode_slots=16", "sampler.rows_in_flight=16", "generation.decode_chunk_steps=4",
        "warmstart.steps=0",
        "sampler.openai.port=0", "sampler.openai.model_name=policy", "environment.tool_format=qwen",
        "sampler.openai.max_body_bytes=65536",
        # one client token sends every request here (64 at once in the sharing test); the per-token bound has its
        # own test (test_endpoint_hostile.py)
        "sampler.openai.max_concurrent_per_token=64",
        f"auth.tokens_file={tokens['table']}"])
    _, tok = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tok.vocab_size, seed=0)
    engine = continuous.build(cfg, model, tok)
    with openai_endpoint(cfg, 0, "sampler-0", engine, tok, lambda: (model.params, VERSION), None) as endpoint:
        client = openai.OpenAI(base_url=endpoint.url, api_key=tokens["client"].read_text().strip(), max_retries=0)
        yield endpoint, client, engine, model, tok, tokens


def _engine(engine, model, prompt: list[int], n: int, seed: int, greedy: bool = False):
    out = engine.generate(model.params, [prompt] * n, jax.random.key(seed), greedy=greedy)
    return [(out.tokens[i, :out.lengths[i]].tolist(), out.logprobs[i, :out.lengths[i]]) for i in range(n)]


def test_seeded_chat_returns_the_engines_own_generation(served):
    endpoint, client, engine, model, tok, _ = served
    messages = [{"role": "user", "content": "Add 12 and 30."}]
    reply = client.chat.completions.create(model="policy", messages=messages, n=3, seed=11, logprobs=True,
                                           extra_body={"return_token_ids": True})
    prompt = reply.model_extra["prompt_token_ids"]
    assert prompt == tok.encode(tok.render_chat(messages, add_generation_prompt=True))
    for choice, (tokens, logprobs) in zip(reply.choices, _engine(engine, model, prompt, 3, 11)):
        assert choice.model_extra["token_ids"] == tokens
        assert np.allclose([t.logprob for t in choice.logprobs.content], logprobs, atol=1e-5)
        assert choice.message.content == tok.decode(tokens)
        assert choice.finish_reason == ("stop" if tokens[-1] in tok.eos_ids else "length")
        written = [t for t, token in zip(choice.logprobs.content, tokens) if token not in tok.eos_ids]
        assert bytes(b for t in written for b in t.bytes).decode() == choice.message.content  # the tokens' own bytes
        # the stop token is its own text in both, as vLLM writes it (its token was "" beside bytes that held it)
        assert all(t.token == bytes(t.bytes).decode() != "" for t, token in zip(choice.logprobs.content, tokens)
                   if token in tok.eos_ids)
    assert reply.system_fingerprint == f"policy-v{VERSION}" and reply.usage.prompt_tokens == len(prompt)
    greedy = client.chat.completions.create(model="policy", messages=messages, temperature=0, max_tokens=8,
                                            extra_body={"return_token_ids": True})
    expected = engine.generate(model.params, [prompt], jax.random.key(0), greedy=True, max_new_tokens=[8])
    assert greedy.choices[0].model_extra["token_ids"] == expected.tokens[0, :expected.lengths[0]].tolist()


def test_completions_take_text_or_token_ids_and_cut_at_stop_strings(served):
    endpoint, client, engine, model, tok, _ = served
    ids = tok.encode("The sum of 4 and 5 is")
    by_text = client.completions.create(model="policy", prompt="The sum of 4 and 5 is", max_tokens=C, seed=5,
                                        logprobs=0, extra_body={"return_token_ids": True})
    by_ids = client.completions.create(model="policy", prompt=ids, max_tokens=C, seed=5, logprobs=0,
                                       extra_body={"return_token_ids": True})
    (tokens, logprobs), = _engine(engine, model, ids, 1, 5)
    for reply in (by_text, by_ids):
        choice = reply.choices[0]
        assert choice.model_extra["prompt_token_ids"] == ids and choice.model_extra["token_ids"] == tokens
        assert np.allclose(choice.logprobs.token_logprobs, logprobs, atol=1e-5)
    text = tok.decode(tokens)
    stop = next((text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip()), None)
    if stop is not None:  # cut: the text before the stop string, the ids up to the token that completes it
        cut = client.completions.create(model="policy", prompt=ids, max_tokens=C, seed=5, stop=[stop],
                                        extra_body={"return_token_ids": True}).choices[0]
        assert cut.text == text[:text.index(stop)] and cut.finish_reason == "stop"
        kept = cut.model_extra["token_ids"]
        assert kept == tokens[:len(kept)] and stop in tok.decode(kept) and stop not in tok.decode(kept[:-1])


def test_a_continued_conversation_keeps_the_sampled_ids(served):
    endpoint, client, engine, model, tok, _ = served
    messages = [{"role": "user", "content": "Add 7 and 8."}]
    first = client.chat.completions.create(model="policy", messages=messages, seed=2, max_tokens=12,
                                           extra_body={"return_token_ids": True})
    answer = first.choices[0].message
    follow = messages + [answer.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}),
                         {"role": "user", "content": "And 9 more?"}]
    second = client.chat.completions.create(model="policy", messages=follow, seed=3, max_tokens=8,
                                            extra_body={"return_token_ids": True})
    so_far = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"][:len(so_far)] == so_far
    assert endpoint.core.chat_prompts.continued >= 1


def test_an_answer_cut_at_a_stop_string_is_continued_from_what_the_client_saw(served):
    """The answer's ids end in the stop string's tokens, which the client never saw: its next turn is the visible
    conversation rendered whole, never the remembered ids with the stop string in them."""
    endpoint, client, _, _, tok, _ = served
    messages = [{"role": "user", "content": "Add 7 and 8."}]
    for seed in range(40):  # an answer with a stop string to cut at past its start
        text = client.chat.completions.create(model="policy", messages=messages, seed=seed, max_tokens=C,
                                              ).choices[0].message.content
        stop = next((text[i:i + 2] for i in range(4, len(text) - 1) if text[i:i + 2].strip()), None)
        if stop is not None and text.index(stop) >= 4:
            break
    else:
        raise AssertionError("no seed gave an answer with a stop string to cut at")
    cut = client.chat.completions.create(model="policy", messages=messages, seed=seed, max_tokens=C, stop=[stop],
                                         extra_body={"return_token_ids": True}).choices[0]
    assert cut.finish_reason == "stop" and stop in tok.decode(cut.model_extra["token_ids"])
    follow = messages + [{"role": "assistant", "content": cut.message.content}, {"role": "user", "content": "More?"}]
    rendered_whole = endpoint.core.chat_prompts.rendered_whole
    second = client.chat.completions.create(model="policy", messages=follow, seed=3, max_tokens=4,
                                            extra_body={"return_token_ids": True})
    assert second.model_extra["prompt_token_ids"] == tok.encode(tok.render_chat(follow, add_generation_prompt=True))
    assert endpoint.core.chat_prompts.rendered_whole == rendered_whole + 1


def test_tool_calls_come_back_as_tool_calls(served):
    endpoint, _, _, _, _, _ = served
    message, calls = endpoint.core._message('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, '
                                            '"b": 2}}\n</tool_call>', [{"type": "function"}])
    assert calls and message["content"] == "Let me add."
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    plain, calls = endpoint.core._message("no call here", [{"type": "function"}])
    assert not calls and plain == {"role": "assistant", "content": "no call here"}


@pytest.mark.parametrize("ask, field", [
    ({"temperature": 0.5}, "temperature"), ({"top_p": 0.9}, "top_p"), ({"max_tokens": C + 1}, "max_tokens"),
    ({"n": 65}, "n"), ({"extra_body": {"top_logprobs": 3}}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"max_completion_tokens": C + 1}, "max_completion_tokens"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(served, ask, field):
    _, client, _, _, _, _ = served
    kwargs = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], **ask}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**kwargs)
    assert caught.value.status_code == 400 and field in caught.value.body["message"]


def test_an_unknown_model_or_route_is_a_404_in_openais_shape(served):
    """As OpenAI and vLLM answer them: the SDK raises NotFoundError, and reads the message from error.message."""
    endpoint, client, _, _, _, _ = served
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert caught.value.body["param"] == "model" and "'policy'" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("policy")
    assert "/v1/models/policy" in caught.value.body["message"]
    verb = httpx.get(endpoint.url + "/chat/completions", headers={"Authorization": f"Bearer {client.api_key}"})
    assert verb.status_code == 405 and verb.json()["error"]["type"] == "invalid_request_error"


def test_a_streamed_answer_is_openais_event_stream_of_the_same_answer(served):
    """stream=True: the openai SDK reads chunks that add up to the unstreamed answer (same seed), each choice
    ending with its finish_reason, the usage in a last chunk without choices (include_usage), then [DONE]."""
    _, client, _, _, _, _ = served
    ask = {"model": "policy", "messages": [{"role": "user", "content": "Add 5 and 6."}], "seed": 7, "n": 2,
           "logprobs": True, "max_tokens": 12}
    whole = client.chat.completions.create(**ask)
    texts, finishes, logprobs, usage = ["", ""], [None, None], [[], []], []
    for chunk in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk" and chunk.id.startswith("chatcmpl-")
        usage += [chunk.usage] if chunk.usage else []
        for choice in chunk.choices:
            assert finishes[choice.index] is None  # nothing of a choice follows its finish_reason
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason
            logprobs[choice.index] += choice.logprobs.content if choice.logprobs else []
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices] and usage == [whole.usage]
    assert logprobs == [c.logprobs.content for c in whole.choices]
    text = client.completions.create(model="policy", prompt="Add 2", seed=1, max_tokens=5, stream=True)
    chunks = list(text)
    plain = client.completions.create(model="policy", prompt="Add 2", seed=1, max_tokens=5)
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason and chunks[-1].usage is None
    raw = httpx.post(client.base_url.join("completions"), headers={"Authorization": f"Bearer {client.api_key}"},
                     json={"model": "policy", "prompt": "Add 2", "max_tokens": 2, "stream": True}, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_calls_without_a_client_token_are_refused(served):
    endpoint, _, _, _, _, tokens = served
    bare = httpx.post(endpoint.url + "/chat/completions", json={"model": "policy", "messages": []})
    assert bare.status_code == 401 and "Bearer" in bare.json()["error"]["message"]
    for key, status in (("not-a-token-at-all-xxxx", 401), (tokens["sampler"].read_text().strip(), 403)):
        with pytest.raises(openai.APIStatusError) as caught:
            openai.OpenAI(base_url=endpoint.url, api_key=key, max_retries=0).models.list()
        assert caught.value.status_code == status
    listed = openai.OpenAI(base_url=endpoint.url, api_key=tokens["admin"].read_text().strip()).models.list()
    assert [m.id for m in listed.data] == ["policy"]


def test_concurrent_requests_share_the_engine_with_the_samplers_batches(served):
    """64 requests at once while a 'sampler' thread keeps generating batches on the same engine: every request is
    answered, and some of them inside the sampler's own batches."""
    endpoint, client, engine, model, tok, _ = served
    stop, batches = threading.Event(), []
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": f"Add {i} and 2."}],
                                          add_generation_prompt=True)) for i in range(8)]

    def sampler():
        while not stop.is_set():
            batches.append(engine.generate(model.params, prompts, jax.random.key(len(batches))))

    before = endpoint.queue.served_in_sampler_batches
    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            replies = list(pool.map(lambda i: client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": f"Add {i} and {i}."}], max_tokens=8,
                extra_body={"return_token_ids": True}), range(64)))
    finally:
        stop.set()
        thread.join()
    assert len(replies) == 64 and all(1 <= len(r.choices[0].model_extra["token_ids"]) <= 8 for r in replies)
    assert len(batches) >= 1 and endpoint.queue.served_in_sampler_batches > before


def test_greedy_requests_ride_a_busy_samplers_stream(served):
    """A sampler's rollout stream keeps the engine busy (long sampled groups, started as others end) while greedy and
    sampled requests arrive: both are answered inside the stream's serve (no pause needed), the greedy one exactly
    the engine's greedy generation."""
    endpoint, client, engine, model, tok, _ = served
    prompt = tok.encode(tok.render_chat([{"role": "user", "content": "Add 3 and 4."}], add_generation_prompt=True))
    stop, started = threading.Event(), []
    stream = RolloutStream(engine.request_keys, lambda run: None)
    serve = threading.Thread(target=engine.serve, args=(model.params, stream, lambda: None, VERSION))
    serve.start()
    before = endpoint.queue.served_in_sampler_batches
    try:
        def feed():
            while not stop.is_set():
                if stream.episodes_in_flight <= 8:
                    work = GroupWork(types.SimpleNamespace(prompt_id="p", answer="7"), prompt, 4,
                                     RewardSet({"answer_correct": 1.0}), f"g{len(started)}", len(started),
                                     jax.random.key(len(started)))
                    started.append(stream.start(work, SingleTurn(C)))
                stream.wait_change(0.01)
        feeder = threading.Thread(target=feed)
        feeder.start()
        deadline = time.monotonic() + 120
        while len(started) < 3 and time.monotonic() < deadline:  # the stream is busy before the requests come
            time.sleep(0.01)
        messages = [{"role": "user", "content": "Add 12 and 30."}]
        greedy = client.chat.completions.create(model="policy", messages=messages, temperature=0, max_tokens=8,
                                                extra_body={"return_token_ids": True})
        sampled = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, seed=3)
    finally:
        stop.set()
        feeder.join()
        stream.close()
        serve.join(60)
    ids = greedy.model_extra["prompt_token_ids"]
    expected = engine.generate(model.params, [ids], jax.random.key(0), greedy=True, max_new_tokens=[8])
    assert greedy.choices[0].model_extra["token_ids"] == expected.tokens[0, :expected.lengths[0]].tolist()
    assert sampled.choices[0].message.content is not None
    assert endpoint.queue.served_in_sampler_batches - before == 2 and len(started) >= 3


def test_a_full_queue_or_an_oversized_body_is_refused_at_once(served):
    endpoint, client, _, _, _, _ = served
    limit = endpoint.queue.max_queued
    endpoint.queue.max_queued = 1
    try:
        with pytest.raises(openai.RateLimitError) as caught:  # 2 sequences > 1 place: none is queued
            client.completions.create(model="policy", prompt="Add 2 and 3.", n=2, max_tokens=4)
        assert caught.value.response.headers["retry-after"] == "1" and not endpoint.queue.has()
    finally:
        endpoint.queue.max_queued = limit
    token = client.api_key
    big = httpx.post(endpoint.url + "/completions", headers={"Authorization": f"Bearer {token}"},
                     content=b'{"model": "policy", "prompt": "' + b"x" * (70 << 10) + b'"}')
    assert big.status_code == 413 and "max_body_bytes" in big.json()["error"]["message"]


def test_tls_serves_with_the_grpc_servers_certificate(chat_family_dirs, tmp_path):  # noqa: F811
    """tls.enabled: the endpoint speaks HTTPS with tls.cert_file; a client trusting another CA is refused."""
    from tests.pki import make_pki

    pki = make_pki(tmp_path / "pki")
    tokens = write_tokens(tmp_path / "auth")
    cfg = load_config(CONFIGS / "tiny_arith.yaml", [
        "warmstart.steps=0", "sampler.openai.port=0", "sampler.openai.model_name=tiny",
        f"auth.tokens_file={tokens['table']}", "tls.enabled=true", f"tls.cert_file={pki['server_cert']}",
        f"tls.key_file={pki['server_key']}", f"tls.ca_file={pki['ca']}"])
    _, tok = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tok.vocab_size, seed=0)
    with openai_endpoint(cfg, 0, "sampler-0", continuous.build(cfg, model, tok), tok, lambda: (model.params, 0),
                         None) as endpoint:
        assert endpoint.url.startswith("https://127.0.0.1:")
        key = tokens["client"].read_text().strip()
        trusted = openai.OpenAI(base_url=endpoint.url, api_key=key, max_retries=0,
                                http_client=httpx.Client(verify=str(pki["ca"])))
        reply = trusted.completions.create(model="tiny", prompt="Q: Tom has 3 apples. A:", max_tokens=4, seed=1)
        assert reply.choices[0].text is not None
        with pytest.raises(openai.APIConnectionError):
            openai.OpenAI(base_url=endpoint.url, api_key=key, max_retries=0,
                          http_client=httpx.Client(verify=str(pki["rogue_ca"]))).models.list()


def test_messages_this_policy_cannot_read_are_a_400(served):
    _, client, _, _, _, _ = served
    with pytest.raises(openai.BadRequestError) as caught:  # an image part: the policy reads text only
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert "messages[0].content" in caught.value.body["message"]


def test_what_an_eval_harness_sends_is_served(served):
    """lm-eval's local-completions: greedy, its task's `until` strings and the EOS text as `stop` (humaneval: 6; OpenAI
    takes 4, vLLM any number), and harnesses pin vLLM's neutral sampling controls (top_k 0, min_p 0,
    repetition_penalty 1): the answer is the engine's greedy generation, cut at the first stop string."""
    _, client, engine, model, tok, _ = served
    ids = tok.encode("def add(a, b):")
    expected = engine.generate(model.params, [ids], jax.random.key(0), greedy=True, max_new_tokens=[C])
    text = tok.decode(expected.tokens[0, :expected.lengths[0]].tolist())
    own = next((text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip()), "\nreturn")
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", own]
    reply = client.completions.create(model="policy", prompt=ids, max_tokens=C, temperature=0, seed=1234, stop=stops,
                                      extra_body={"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0})
    first = min((text.index(s) for s in stops if s in text), default=len(text))
    assert reply.choices[0].text == text[:first]
