"""Runs in the vLLM environment (started by tests/unit/sampler_service/test_vllm_engine.py): the vLLM engine
against the JAX policy on the same weights. Writes the measurements as JSON; the test asserts on them.

    python engine_check.py MODEL_DIR INSTALL_MODE OUT.json
"""

import json
import os
import pathlib
import sys
import time

import numpy as np


def main(model_dir: str, mode: str, out_path: str) -> None:
    import jax
    import jax.numpy as jnp

    from grpo_stream.common.config.schema import VllmSection
    from grpo_stream.common.engine.continuous import ContinuousEngine
    from grpo_stream.common.model.policy import load_hf_model, sequence_logprobs
    from grpo_stream.common.tasks.arith import ArithTask
    from grpo_stream.common.model.tokenizer import HFTokenizer
    from grpo_stream.common.engine.vllm_engine import VllmEngine

    tok = HFTokenizer(model_dir)
    model = load_hf_model(model_dir)
    prompt_tokens, new_tokens, temperature = 24, 16, 0.9
    started = time.monotonic()
    engine = VllmEngine(model_dir, model, tok.pad_id, tok.eos_ids, prompt_tokens, new_tokens, temperature,
                        VllmSection(kv_cache_gib=0.25, enforce_eager=True, weight_install=mode))
    start_s = time.monotonic() - started
    prompts = [tok.encode(p.prompt) for p in ArithTask(10, 99, 0.1, seed=0).heldout(6)]
    rows = [ids for ids in prompts for _ in range(4)]

    # behaviour logprobs: vLLM's sampled-token logprobs against the trainer's recomputation on the same weights
    out = engine.generate(model.params, rows, 7)
    tokens = np.full((len(rows), prompt_tokens + new_tokens), tok.pad_id, np.int32)
    valid = np.zeros(tokens.shape, np.bool_)
    for i, ids in enumerate(rows):
        n = int(out.lengths[i])
        tokens[i, prompt_tokens - len(ids):prompt_tokens] = ids
        tokens[i, prompt_tokens:prompt_tokens + n] = out.tokens[i, :n]
        valid[i, prompt_tokens - len(ids):prompt_tokens + n] = True
    recomputed = np.asarray(sequence_logprobs(model, model.params, jnp.asarray(tokens), jnp.asarray(valid),
                                              temperature, tok.pad_id))[:, prompt_tokens - 1:]
    in_completion = np.arange(new_tokens)[None, :] < out.lengths[:, None]
    diff = np.abs(np.where(in_completion, recomputed - out.logprobs, 0.0))
    again = engine.generate(model.params, rows, 7)  # the same seed: the same completions

    # a new version: greedy outputs before and after the install, and the JAX engine's on the new weights
    jax_engine = ContinuousEngine(model, tok.pad_id, tok.eos_ids, prompt_tokens, new_tokens, temperature)
    before = engine.generate(model.params, prompts, 0, greedy=True)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    new_params = jax.tree_util.tree_map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype),
                                        model.params)
    after = engine.generate(new_params, prompts, 0, greedy=True)
    reference = jax_engine.generate(new_params, prompts, jax.random.key(0), greedy=True)
    ends = [int(n) for n in after.lengths]
    result = {
        "mode": engine.install_mode, "tied_heads_loaded": engine.tied_heads_loaded, "engine_start_s": start_s,
        "installs_s": engine.install_seconds,
        "kv_cache_memory_bytes": engine.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes,
        "tokens_scored": int(in_completion.sum()), "logprob_max_abs_diff": float(diff.max()),
        "logprob_mean": float(np.where(in_completion, out.logprobs, 0).sum() / in_completion.sum()),
        "finished": int(out.finished.sum()), "same_seed_same_tokens": bool((again.tokens == out.tokens).all()),
        "greedy_before": before.tokens.tolist(), "greedy_after": after.tokens.tolist(),
        "greedy_jax_after": reference.tokens.tolist(), "greedy_lengths_after": ends,
        "greedy_jax_lengths_after": [int(n) for n in reference.lengths],
        # the workers got the weights without vLLM's pickle fallback (which would let its IPC run any code)
        "insecure_serialization": os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION"),
    }
    # in-flight updates with the files install (its engine core in another process, stepping on while a version
    # installs): refused before vLLM starts
    from grpo_stream.common.runtime.errors import PermanentError

    try:
        VllmEngine(model_dir, model, tok.pad_id, tok.eos_ids, prompt_tokens, new_tokens, temperature,
                   VllmSection(kv_cache_gib=0.25, enforce_eager=True, weight_install="files"), in_flight=True)
        result["in_flight_files"] = "started"
    except PermanentError as exc:
        result["in_flight_files"] = str(exc)
    pathlib.Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":  # the vLLM engine core may spawn processes: the guard is required
    main(*sys.argv[1:4])
