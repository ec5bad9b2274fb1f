"""Runs in the vLLM environment, started by bench/sampler.py: decode tokens/s of the vLLM engine on the model
the JAX engine was just timed on (same weights, batch, lengths, temperature 1, per-token logprobs, no early
stop), medians of `repeats` runs after a warm-up. Prints one JSON object.

    python -m grpo_stream.bench.vllm_decode MODEL_DIR BATCH PROMPT_TOKENS NEW_TOKENS REPEATS
"""

import json
import statistics
import sys
import time

import numpy as np


def main(model_dir: str, batch: int, prompt_tokens: int, new_tokens: int, repeats: int) -> dict:
    from grpo_stream.common.config.schema import VllmSection
    from grpo_stream.common.model.policy import load_hf_model
    from grpo_stream.common.engine.vllm_engine import VllmEngine

    model = load_hf_model(model_dir)
    started = time.perf_counter()
    engine = VllmEngine(model_dir, model, pad_id=0, eos_ids=[], max_prompt_tokens=prompt_tokens,
                        max_new_tokens=new_tokens, temperature=1.0,
                        settings=VllmSection(gpu_memory_utilization=0.3, max_num_seqs=max(batch, 1)))
    start_seconds = time.perf_counter() - started
    rng = np.random.default_rng(0)
    prompts = [list(map(int, row)) for row in rng.integers(1, model.arch.vocab_size, (batch, prompt_tokens))]
    first = engine.generate(model.params, prompts, 0)  # installs the weights, warms up
    if not np.all(first.lengths == new_tokens):
        raise RuntimeError("vLLM stopped early; no stop token was meant to exist")
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        engine.generate(model.params, prompts, r + 1)
        times.append(time.perf_counter() - t0)
    import vllm  # noqa: PLC0415

    return {"tokens_per_second": batch * new_tokens / statistics.median(times),
            "engine_start_seconds": round(start_seconds, 1), "version": vllm.__version__}


if __name__ == "__main__":  # vLLM's engine core may spawn processes: the guard is required
    a = sys.argv[1:]
    print(json.dumps(main(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]))))
