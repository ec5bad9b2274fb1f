"""The sampler's generation engine, chosen by sampler.engine: the JAX engine or vLLM.

Both take `generate(params, prompts, rng, greedy)` and return a
`grpo_stream.common.engine.jax_engine.Generation` with the policy's per-token logprobs, and both
switch to a new weight version only when they are handed new params between
batches, so the sampler's version and staleness rules do not depend on the
engine. `fixed_shape` says whether batches must keep one shape (the JAX
engine compiles one program per shape; vLLM takes any batch).
"""

from __future__ import annotations

import pathlib
import tempfile

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.engine.jax_engine import Engine


def build_engine(cfg: RunConfig, model, tokenizer, index: int = 0):
    """The engine sampler `index` generates with; `model` is its (abstract) policy model, whose parameter names
    and architecture the published weights follow."""
    gen = cfg.generation
    if cfg.sampler.engine == "jax":
        return Engine(model, tokenizer.pad_id, tokenizer.eos_ids, gen.max_prompt_tokens, gen.max_new_tokens,
                      gen.temperature)
    from grpo_stream.common.model.hf_checkpoint import resolve_model_dir, write_hf_config  # noqa: PLC0415
    from grpo_stream.sampler_service.vllm_engine import VllmEngine  # noqa: PLC0415

    if cfg.model.kind == "hf":
        model_dir = resolve_model_dir(cfg.model.path)
    else:  # the tiny model has no directory: vLLM builds it from the config.json it would be exported with
        model_dir = pathlib.Path(tempfile.mkdtemp(prefix="grpo-vllm-model-"))
        write_hf_config(model_dir, model.arch, cfg.model.dtype, tokenizer.eos_ids, tokenizer.pad_id)
    return VllmEngine(model_dir, model, tokenizer.pad_id, tokenizer.eos_ids, gen.max_prompt_tokens, gen.max_new_tokens,
                      gen.temperature, cfg.sampler.vllm, dtype=cfg.model.dtype, seed=cfg.run.seed * 1000 + index)
