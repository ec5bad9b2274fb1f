"""Runs in the vLLM environment (started by tests/unit/common/engine/test_vllm_serve.py): the samplers' OpenAI-
compatible endpoint over the vLLM engine. Writes the measurements as JSON; the test asserts on them.

    python -m tests.vllm_scripts.endpoint_check MODEL_DIR OUT.json      (from the repository root)

- a seeded text completion (text and token-id prompts) returns the engine's own `generate` for that seed;
- 16 requests at once while a thread keeps generating batches on the engine (a sampler's work): every one
  answered, some inside those batches.
"""

import concurrent.futures
import json
import sys
import threading


def main(model_dir: str, out_path: str) -> None:
    import jax
    import openai

    from grpo_stream.common.config.loading import load_config
    from grpo_stream.common.config.schema import VllmSection
    from grpo_stream.common.engine.vllm_engine import VllmEngine
    from grpo_stream.common.model.policy import load_hf_model
    from grpo_stream.common.model.tokenizer import HFTokenizer
    from grpo_stream.sampler_service.openai_server import openai_endpoint

    cfg = load_config(None, ["generation.max_prompt_tokens=24", "generation.max_new_tokens=32",
                             "generation.temperature=0.9", "sampler.openai.port=0", "sampler.openai.model_name=tiny",
                             "auth.mode=none"])
    tok = HFTokenizer(model_dir)
    model = load_hf_model(model_dir)
    engine = VllmEngine(model_dir, model, tok.pad_id, tok.eos_ids, 24, 32, 0.9,
                        VllmSection(kv_cache_gib=0.25, enforce_eager=True, max_num_seqs=8))
    result = {}
    with openai_endpoint(cfg, 0, "sampler-0", engine, tok, lambda: (model.params, 0), None) as endpoint:
        client = openai.OpenAI(base_url=endpoint.url, api_key="none", max_retries=0, timeout=300)
        ids = tok.encode("Q: Ana has 12 coins and gets 30 more. How many coins now? A:")[:24]
        out = engine.generate(model.params, [ids] * 2, jax.random.key(7))
        expected = [out.tokens[i, :out.lengths[i]].tolist() for i in range(2)]
        expected_lp = [out.logprobs[i, :out.lengths[i]].tolist() for i in range(2)]
        reply = client.completions.create(model="tiny", prompt=ids, n=2, seed=7, max_tokens=32, logprobs=0,
                                          extra_body={"return_token_ids": True})
        got = [c.model_extra["token_ids"] for c in reply.choices]
        result["seeded_tokens_equal"] = got == expected
        result["seeded_logprob_max_diff"] = max(abs(a - b) for c, e in zip(reply.choices, expected_lp)
                                               for a, b in zip(c.logprobs.token_logprobs, e))
        result.update(_concurrent(engine, model, client, ids, endpoint))
    pathlib_write(out_path, result)


def _concurrent(engine, model, client, ids, endpoint) -> dict:
    import jax

    stop, batches = threading.Event(), []

    def sampler():
        while not stop.is_set():
            batches.append(engine.generate(model.params, [ids] * 4, jax.random.key(len(batches))))

    thread = threading.Thread(target=sampler)
    thread.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda i: client.completions.create(
                model="tiny", prompt=ids, max_tokens=8, seed=i, extra_body={"return_token_ids": True}), range(16)))
    finally:
        stop.set()
        thread.join()
    return {"answered": sum(1 <= len(r.choices[0].model_extra["token_ids"]) <= 8 for r in replies),
            "sampler_batches": len(batches), "in_sampler_batches": endpoint.queue.served_in_sampler_batches}


def pathlib_write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
