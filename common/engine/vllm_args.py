"""The keyword arguments the vLLM engine (vllm_engine.py) starts `vllm.LLM` with, and what a failed start says.

sampler.vllm.engine_args is a free mapping (the config loads where vLLM is not installed), so its names are checked
against the installed vLLM before it starts (`check_known`): a name this vLLM does not take (a typo, or one an older
vLLM had) fails every restart the same way, so it is a permanent error naming the field. A start that fails
(`start_failure`) is reported with each argument that came from the run's config beside the field that set it, so
that vLLM's own words ("increase gpu_memory_utilization or decrease max_model_len") lead to the setting to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect

from grpo_stream.common.config.vllm_settings import VLLM_RESERVED_ARGS
from grpo_stream.common.engine.vllm_worker import EXTENSION
from grpo_stream.common.runtime.errors import PermanentError


def llm_args(model_dir, settings, platform, dtype: str, seed: int, in_flight: bool, install_mode: str,
             context_capacity: int) -> dict:
    """Every keyword argument of `vllm.LLM`: the engine's fixed ones, those from the run's config (`settings`: the
    sampler.vllm section) and `engine_args`."""
    fixed = dict(model=str(model_dir), skip_tokenizer_init=True, load_format="dummy",
                 logprobs_mode="processed_logprobs", dtype=dtype, max_model_len=context_capacity,
                 gpu_memory_utilization=settings.gpu_memory_utilization,
                 tensor_parallel_size=settings.tensor_parallel_size, max_num_seqs=settings.max_num_seqs,
                 enforce_eager=settings.enforce_eager, enable_prefix_caching=settings.prefix_caching, seed=seed)
    return {**fixed, **engine_args(settings, platform, in_flight, install_mode, context_capacity)}


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


def accepted_args(llm_class) -> set[str]:
    """The keyword arguments `llm_class` (vllm.LLM) takes: its own, and the EngineArgs fields its **kwargs go to."""
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 - deferred: vLLM lives in its own environment

    own = {name for name, p in inspect.signature(llm_class.__init__).parameters.items()
           if name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return own | {f.name for f in dataclasses.fields(EngineArgs) if f.init}


def check_known(given: dict, accepted: set[str]) -> None:
    """Refuse the names of sampler.vllm.engine_args (`given`) that the installed vLLM does not take (`accepted`)."""
    unknown = sorted(set(given) - accepted)
    if unknown:
        near = {name: difflib.get_close_matches(name, accepted, 1) for name in unknown}
        hints = "; ".join(f"{name}: did you mean {near[name][0]}?" for name in unknown if near[name])
        raise PermanentError(f"sampler.vllm.engine_args names {unknown}, which this vLLM's LLM does not take"
                             f"{' (' + hints + ')' if hints else ''}; remove or rename them (vLLM's engine "
                             "arguments: vllm.engine.arg_utils.EngineArgs)")


def start_failure(exc: Exception, args: dict, given: dict) -> RuntimeError:
    """The error of a vLLM start that raised `exc`, started with `args` (`given`: sampler.vllm.engine_args): vLLM's
    words, then each argument the run's config set, named by its field."""
    from_config = [f"{name}={value!r} ({where})" for name, value in args.items()
                   if (where := VLLM_RESERVED_ARGS.get(name)) and not where.startswith("nowhere") and name not in given
                   and name != "model"]
    from_config += [f"{name}={given[name]!r} (sampler.vllm.engine_args)" for name in given]
    return RuntimeError(f"vLLM did not start ({type(exc).__name__}: {exc}); its arguments from the run's config: "
                        f"{', '.join(from_config)}")
