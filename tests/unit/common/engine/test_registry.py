"""Engine choice by sampler.engine: the JAX engine, or vLLM, which must say how to get it where it is missing."""

import collections
import importlib.util
from types import SimpleNamespace

import jax
import pytest

from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.engine.registry import build_engine
from grpo_stream.common.engine.vllm_requests import seed_of as _seed_of
from grpo_stream.common.engine.vllm_requests import Live, check_ended as _check_ended, drop_withdrawn


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


def test_endpoint_requests_whose_caller_left_are_aborted_in_vllm_and_dropped_waiting():
    """The vLLM serve's side of a withdrawn endpoint request: aborted if it is in vLLM, dropped if it waits, the
    sampler's own requests untouched."""
    from grpo_stream.common.engine.base import Request  # noqa: PLC0415

    left, waiting_left, stays = object(), object(), object()
    requests = {name: Request(ids=[1], budget=2, key=0, tag=tag)
                for name, tag in (("left", left), ("waiting_left", waiting_left), ("stays", stays))}
    live = {"grpo-1": Live(requests["left"], None, False), "grpo-2": Live(requests["stays"], None, False)}
    pending = collections.deque([requests["waiting_left"], requests["stays"]])
    aborted = []
    engine = SimpleNamespace(abort_request=aborted.extend)
    drop_withdrawn(SimpleNamespace(withdrawn=lambda: {left, waiting_left}), pending, live, engine)
    assert aborted == ["grpo-1"] and list(live) == ["grpo-2"] and list(pending) == [requests["stays"]]
    drop_withdrawn(SimpleNamespace(), pending, live, engine)  # a source of the sampler's own: nothing withdrawn
    assert aborted == ["grpo-1"] and len(live) == 1 and len(pending) == 1
