"""The keyword arguments the vLLM engine (vllm_engine.py) builds `vllm.LLM` with beyond its fixed ones."""

from __future__ import annotations

from grpo_stream.common.engine.vllm_worker import EXTENSION


def engine_args(settings, platform, in_flight: bool, install_mode: str, context_capacity: int) -> dict:
    """sampler.vllm.engine_args (`settings`: the sampler.vllm section) and what the engine needs on `platform` (vLLM's
    current_platform): `in_flight` weight updates, its weight `install_mode`, a context of `context_capacity`."""
    args = dict(settings.engine_args)
    if in_flight:
        args["async_scheduling"] = False  # a step's tokens come back before the next step is launched
    if platform.is_cpu() and "enable_chunked_prefill" not in args:
        # vLLM's CPU backend crashes ("CPU Generator does not use offset") when a seeded request's prompt is
        # prefilled over several steps: it rewinds the request's generator, which a CPU generator cannot do.
        # Every sampled request is seeded, so prompts are prefilled whole (the step budget must hold one)
        args["enable_chunked_prefill"] = False
        args["max_num_batched_tokens"] = max(args.get("max_num_batched_tokens", 0), context_capacity, 4096)
    if install_mode == "files":  # the workers' loading method, called by name (vllm_worker.py)
        args["worker_extension_cls"] = EXTENSION
    if settings.kv_cache_gib is not None:
        args["kv_cache_memory_bytes"] = int(settings.kv_cache_gib * 2**30)
    return args
