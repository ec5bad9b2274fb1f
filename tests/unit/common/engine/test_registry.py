"""Engine choice by sampler.engine: the JAX engine, or vLLM, which must say how to get it where it is missing."""

import importlib.util
from types import SimpleNamespace

import jax
import pytest

from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.engine.registry import build_engine
from grpo_stream.common.engine.vllm_engine import _check_ended, _seed_of


def test_jax_engine_is_the_default(tiny_parts):
    cfg, _, tokenizer, model = tiny_parts
    engine = build_engine(cfg, model, tokenizer)
    assert isinstance(engine, ContinuousEngine)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this environment")
def test_vllm_engine_without_vllm_names_the_install_command(tiny_parts):
    cfg, _, tokenizer, model = tiny_parts
    cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"engine": "vllm"})})
    with pytest.raises(RuntimeError, match="requirements/install-vllm-env.sh"):
        build_engine(cfg, model, tokenizer)


def test_row_seeds_follow_the_jax_key():
    key = jax.random.key(3)
    assert _seed_of(key) == _seed_of(jax.random.key(3)) != _seed_of(jax.random.key(4))
    assert _seed_of(jax.random.fold_in(key, 1)) != _seed_of(key)
    assert _seed_of(7) == 7 and 0 <= _seed_of(key) < 2**63


def _ended(reason):
    return SimpleNamespace(request_id="grpo-7", outputs=[SimpleNamespace(finish_reason=reason, token_ids=[5, 6])])


def test_a_request_vllm_ended_itself_fails_the_serve_instead_of_training_as_truncated():
    """vLLM's own abort or request error leaves a partial completion: it must not be scored as one cut at its
    budget (truncation, an overlong penalty); the completion's own ends pass."""
    for reason in ("abort", "error"):
        with pytest.raises(RuntimeError, match=f"grpo-7 with finish_reason='{reason}'"):
            _check_ended(_ended(reason))
    for reason in ("stop", "length", "repetition"):
        _check_ended(_ended(reason))
