"""The JAX engine: logprobs must match the trainer's full-sequence recomputation."""

import jax
import numpy as np
import pytest

from grpo_stream.common.engine.jax_engine import Engine
from grpo_stream.common.model.policy import sequence_logprobs
from grpo_stream.trainer_service.batching import layout


@pytest.fixture(scope="module")
def engine(tiny_parts):
    cfg, task, tok, model = tiny_parts
    return Engine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens,
                  temperature=0.7)


def _prompts(task, tok, n):
    return [tok.encode(task.train_problem(i).prompt) for i in range(n)]


def test_behaviour_logprobs_equal_recomputed(tiny_parts, engine):
    cfg, task, tok, model = tiny_parts
    prompts = _prompts(task, tok, 8)
    out = engine.generate(model.params, prompts, jax.random.key(np.random.randint(1 << 30)))
    p, c = cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens
    rows = [layout(np.array(pr), out.tokens[i, :out.lengths[i]], p, c, tok.pad_id) for i, pr in enumerate(prompts)]
    tokens = np.stack([r[0] for r in rows])
    valid = np.stack([r[1] for r in rows])
    recomputed = np.asarray(sequence_logprobs(model, model.params, tokens, valid, 0.7, tok.pad_id))[:, p - 1:]
    for i in range(len(prompts)):
        n = out.lengths[i]
        np.testing.assert_allclose(recomputed[i, :n], out.logprobs[i, :n], atol=1e-4)
    assert (out.logprobs <= 0).all()


def test_pad_is_never_sampled_and_eos_ends_completions(tiny_parts, engine):
    cfg, task, tok, model = tiny_parts
    out = engine.generate(model.params, _prompts(task, tok, 16), jax.random.key(1))
    for i in range(16):
        n = out.lengths[i]
        assert tok.pad_id not in out.tokens[i, :n].tolist()
        assert (out.tokens[i, n:] == tok.pad_id).all() and (out.logprobs[i, n:] == 0).all()
        if out.finished[i]:
            assert out.tokens[i, n - 1] == tok.eos_id
        else:
            assert n == cfg.generation.max_new_tokens


def test_greedy_is_deterministic_and_ignores_rng(tiny_parts, engine):
    _, task, tok, model = tiny_parts
    prompts = _prompts(task, tok, 4)
    a = engine.generate(model.params, prompts, jax.random.key(1), greedy=True)
    b = engine.generate(model.params, prompts, jax.random.key(2), greedy=True)
    np.testing.assert_array_equal(a.tokens, b.tokens)


def test_left_padding_does_not_change_results(tiny_parts, engine):
    """A prompt's greedy completion is the same alone or batched with longer prompts."""
    _, task, tok, model = tiny_parts
    short = tok.encode("Q: Tom has 12 pens and gets 30 more. How many pens now? A:")
    longer = _prompts(task, tok, 3)
    alone = engine.generate(model.params, [short], jax.random.key(0), greedy=True)
    mixed = engine.generate(model.params, [*longer, short], jax.random.key(0), greedy=True)
    np.testing.assert_array_equal(alone.tokens[0], mixed.tokens[-1])


def test_too_long_prompt_is_refused(tiny_parts, engine):
    cfg, _, _, model = tiny_parts
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        engine.generate(model.params, [[5] * (cfg.generation.max_prompt_tokens + 1)], jax.random.key(0))


def test_named_numpy_roundtrip(tiny_parts):
    _, _, _, model = tiny_parts
    named = model.to_named_numpy()
    assert "layers.0.attn.q_proj.w" in named
    back = model.to_named_numpy(model.from_named_numpy(named))
    for k in named:
        np.testing.assert_array_equal(named[k], back[k])
    bad = dict(named)
    bad["layers.0.attn.q_proj.w"] = bad["layers.0.attn.q_proj.w"][:1]
    with pytest.raises(ValueError, match="layers.0.attn.q_proj.w"):
        model.from_named_numpy(bad)
