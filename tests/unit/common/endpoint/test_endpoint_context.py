"""The OpenAI endpoint's context is its own setting (sampler.openai.max_context_tokens), not the training rollouts'
prompt + completion limit: a chat's later turns are longer prompts. The sampler's engine holds it (KV positions per
sequence), and an engine that cannot is refused naming the field."""

import types

import jax
import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.serving import endpoint_context, engine_context
from grpo_stream.common.endpoint.app import endpoint_core
from grpo_stream.common.endpoint.protocol import CompletionRequest, RequestError
from grpo_stream.common.engine import continuous
from grpo_stream.common.engine.base import FixedRequests, Generation, Request
from grpo_stream.common.engine.side_requests import SideQueue

OVERRIDES = ["generation.max_prompt_tokens=32", "generation.max_new_tokens=16", "sampler.openai.port=0",
             "generation.decode_slots=8", "sampler.rows_in_flight=8"]


def test_the_endpoint_serves_prompts_past_the_rollouts_limit_up_to_its_own(tiny_parts):
    _, _, tok, model = tiny_parts
    cfg = load_config(None, OVERRIDES + ["sampler.openai.max_context_tokens=200"])
    assert endpoint_context(cfg) == 200 and engine_context(cfg) == (200, "sampler.openai.max_context_tokens")
    engine = continuous.build(cfg, model, tok)
    assert engine.context_capacity >= 200
    core = endpoint_core(cfg, engine, SideQueue(8), tok)
    turn_two = [5] * 150  # a conversation's second turn: far past generation.max_prompt_tokens=32
    assert core._budget(CompletionRequest(model=core.model_name, prompt=turn_two, max_tokens=16), [turn_two],
                        "prompt", 16) == 16
    # the engine decodes it as it serves the endpoint's sequences (its KV cache holds 150 + 4 positions)
    out = Generation(np.zeros((1, 16), np.int32), np.zeros((1, 16), np.float32), np.zeros(1, np.int32),
                     np.zeros(1, np.bool_), None)
    key, = engine.request_keys(jax.random.key(0), 1)
    engine.serve(model.params, FixedRequests([Request(turn_two, 4, key, 0)], out))
    assert 1 <= out.lengths[0] <= 4
    with pytest.raises(RequestError, match=r"maximum context length is 200 tokens \(sampler.openai."
                                           r"max_context_tokens\); the prompt has 200"):
        core._budget(CompletionRequest(model=core.model_name, prompt=[5] * 200), [[5] * 200], "prompt", 16)


def test_without_the_field_the_context_is_the_rollouts_and_an_engine_too_small_is_refused(tiny_parts):
    _, _, tok, model = tiny_parts
    cfg = load_config(None, OVERRIDES)
    assert endpoint_context(cfg) == 48 and engine_context(cfg)[0] == 48
    small = continuous.build(cfg, model, tok)  # KV capacity 64 per sequence
    longer = load_config(None, OVERRIDES + ["sampler.openai.max_context_tokens=500"])
    with pytest.raises(ValueError, match=r"sampler.openai.max_context_tokens=500 exceeds this engine's KV capacity "
                                         r"of 64 tokens per sequence"):
        endpoint_core(longer, small, SideQueue(8), tok)
    assert endpoint_core(cfg, types.SimpleNamespace(context_capacity=64), SideQueue(8), tok).context_tokens == 48
