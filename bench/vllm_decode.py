"""Runs in the vLLM environment, started by bench/sampler_workloads.py: vLLM's useful tokens/s on request sets
(each: prompts and per-row budgets, no stop token; one engine for all), through the vLLM engine (sampler.engine: vllm) with the model's
weights installed by its own install path, temperature 1, per-token logprobs, every row seeded as the sampler
seeds them. Per set, one untimed warm-up run, then `repeats` runs. Prints one JSON object: set name -> result.

    python -m grpo_stream.bench.vllm_decode MODEL_DIR WORKLOAD_JSON
"""

import json
import sys
import time


def main(model_dir: str, workload_path: str) -> dict:
    from grpo_stream.bench.sampler_workloads import Busy, summarize
    from grpo_stream.common.config.schema import VllmSection
    from grpo_stream.common.engine.vllm_engine import VllmEngine
    from grpo_stream.common.model.policy import load_hf_model

    work = json.loads(open(workload_path).read())
    cases = work["cases"]
    model = load_hf_model(model_dir)
    started = time.perf_counter()
    max_prompt = max(len(p) for c in cases.values() for p in c["prompts"])
    max_new = max(b for c in cases.values() for b in c["budgets"])
    # a KV cache that holds max_num_seqs whole sequences at once (what the JAX engine's slots hold), sized to the
    # work instead of a share of the host's memory, so the benchmark does not commit gigabytes it never uses
    arch = model.arch
    token_bytes = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4  # float32 keys and values
    kv_bytes = work["max_num_seqs"] * (max_prompt + max_new) * token_bytes
    engine = VllmEngine(model_dir, model, pad_id=0, eos_ids=[], max_prompt_tokens=max_prompt, max_new_tokens=max_new,
                        temperature=1.0, settings=VllmSection(max_num_seqs=work["max_num_seqs"],
                                                              kv_cache_gib=1.25 * kv_bytes / 2**30 + 0.0625))
    start_seconds = time.perf_counter() - started
    import vllm  # noqa: PLC0415

    results = {}
    for name, case in cases.items():
        prompts, budgets = case["prompts"], case["budgets"]
        first = engine.generate(model.params, prompts, 0, max_new_tokens=budgets)  # installs the weights, warms up
        if list(first.lengths) != list(budgets):
            raise RuntimeError("vLLM's completion lengths differ from the budgets; no stop token was meant to exist")
        runs = []
        for r in range(work["repeats"]):
            with Busy() as run:
                engine.generate(model.params, prompts, r + 1, max_new_tokens=budgets)
            runs.append(run)
        results[name] = summarize(sum(budgets), runs, {"engine_start_seconds": round(start_seconds, 1),
                                                       "version": vllm.__version__})
    return results


if __name__ == "__main__":  # vLLM's engine core may spawn processes: the guard is required
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
