"""The vLLM engine's settings (sampler.vllm), a section of the RunConfig in schema.py."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from grpo_stream.common.config.base import Strict

# vllm.LLM's arguments the engine sets itself, each with where a run sets it (what the refusal of one in engine_args
# names)
VLLM_RESERVED_ARGS = {
    "model": "model.path", "dtype": "sampler.dtype", "seed": "run.seed",
    "max_model_len": "generation.max_prompt_tokens + generation.max_new_tokens, or sampler.openai.max_context_tokens",
    "gpu_memory_utilization": "sampler.vllm.gpu_memory_utilization",
    "kv_cache_memory_bytes": "sampler.vllm.kv_cache_gib",
    "tensor_parallel_size": "sampler.vllm.tensor_parallel_size", "max_num_seqs": "sampler.vllm.max_num_seqs",
    "enforce_eager": "sampler.vllm.enforce_eager", "enable_prefix_caching": "sampler.vllm.prefix_caching",
    **{arg: "nowhere (the engine's own)" for arg in ("logprobs_mode", "skip_tokenizer_init", "load_format",
                                                      "worker_extension_cls")}}


class VllmSection(Strict):
    """The vLLM engine of a sampler (sampler.engine: vllm); see common/engine/vllm_engine.py."""

    gpu_memory_utilization: float = Field(0.5, gt=0, le=0.99, description="Share of accelerator memory (on CPU: of "
                                          "a NUMA node's memory) vLLM takes for weights and KV cache; CPU hosts fail "
                                          "at start near the default 0.92 of vLLM itself.")
    kv_cache_gib: float | None = Field(None, gt=0, le=4096, description="KV cache size in GiB (vLLM's "
                                       "kv_cache_memory_bytes); set, it replaces the gpu_memory_utilization sizing. "
                                       "Size it to the work where vLLM shares a host or a GPU with other processes: on "
                                       "CPU a share of the node's memory is committed in full at start.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="Devices one vLLM engine shards the model over.")
    max_num_seqs: int = Field(256, ge=1, le=65536, description="Most sequences vLLM decodes at once.")
    enforce_eager: bool = Field(False, description="No CUDA graphs / compilation: faster start, slower decoding.")
    prefix_caching: bool = Field(True, description="Share the prompt's KV cache among a group's completions (reset "
                                 "at every weight install, so no completion reads another version's cache).")
    weight_install: Literal["auto", "iterator", "files"] = Field(
        "auto", description="How a published version enters the engine. 'iterator': tensors handed to the model's "
        "load_weights in this process (tensor_parallel_size 1); 'files': written as safetensors to "
        "sampler.vllm.stage_dir, then every vLLM worker reloads from there (any tensor_parallel_size); 'auto': "
        "iterator when tensor_parallel_size is 1, else files.")
    steps_between_updates: int = Field(8, ge=1, le=4096, description="sampler.weight_updates=in_flight: engine "
                                       "steps (one token per live request each) between checks for a newly "
                                       "installed version; a new one is written in place with the scheduler "
                                       "paused, live requests kept.")
    stage_dir: str | None = Field(None, description="weight_install files: a directory on fast local storage (e.g. "
                                  "/dev/shm) for one version's safetensors. Null: a temporary directory.")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="More keyword arguments for vllm.LLM "
                                        "(e.g. {max_num_batched_tokens: 8192}); the sampler refuses a name the "
                                        "installed vLLM does not take at start, before vLLM loads. The ones the engine "
                                        "sets from the run's config (those above, model, dtype, seed, "
                                        "max_model_len, and its own logprobs_mode, skip_tokenizer_init, load_format "
                                        "and worker_extension_cls) cannot be given here.")

    @model_validator(mode="after")
    def _check(self):
        taken = sorted(set(self.engine_args) & VLLM_RESERVED_ARGS.keys())
        if taken:
            where = "; ".join(f"{arg}: {VLLM_RESERVED_ARGS[arg]}" for arg in taken)
            raise ValueError(f"sampler.vllm.engine_args sets {taken}, which the engine sets from the run's config; "
                             f"remove them from engine_args and set instead: {where}")
        if self.weight_install == "iterator" and self.tensor_parallel_size > 1:
            raise ValueError("sampler.vllm.weight_install=iterator needs tensor_parallel_size 1 (the tensors are "
                             "handed over in this process); use files or auto")
        return self
