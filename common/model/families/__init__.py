"""The model families grpo-stream runs, one `ModelFamily` record each, and the registry that finds them.

`REGISTRY` maps a Hugging Face `architectures` name (LlamaForCausalLM, ...) to its record; `family_named` finds one by
`Architecture.family`, `family_for_hf_config` by a parsed config.json. A family is added by writing its record (a
module beside llama.py, qwen.py, gemma.py) and listing it in `FAMILIES`; tests/unit/common/model/test_families.py then
checks every feature for it (ARCHITECTURE.md, "Adding a model family").
"""

from __future__ import annotations

from grpo_stream.common.model.families.gemma import GEMMA2, GEMMA3
from grpo_stream.common.model.families.llama import LLAMA3
from grpo_stream.common.model.families.qwen import QWEN2, QWEN3
from grpo_stream.common.model.families.record import (Architecture, ArchitectureError, DecodeSpec, ModelFamily, NameMap,
                                                       RematSupport, TunixPatches, Unsupported, VllmSupport,
                                                       VllmTpuSupport, family_named, register)

FAMILIES: tuple[ModelFamily, ...] = (LLAMA3, QWEN2, QWEN3, GEMMA2, GEMMA3)
REGISTRY: dict[str, ModelFamily] = {f.hf_architecture: f for f in FAMILIES}
register(FAMILIES)
_BY_MODEL_TYPE = {f.hf_model_type: f for f in FAMILIES}
# model types seen in the wild that we refuse with a reason rather than "not supported"
UNSUPPORTED_MODEL_TYPES = {
    "gemma": "Gemma 1 is not supported",
    "gemma3": "multimodal Gemma 3 checkpoints are not supported; use a text-only one (model_type gemma3_text)",
    "qwen3_moe": "Qwen3 mixture-of-experts is not supported yet",
}
if len(REGISTRY) != len(FAMILIES) or len(_BY_MODEL_TYPE) != len(FAMILIES):
    raise ValueError("two model family records share an architectures name, family or model_type")


def family_of(arch: Architecture) -> ModelFamily:
    return family_named(arch.family)


def family_for_hf_config(config: dict, where: str = "config.json") -> ModelFamily:
    """The record of a parsed config.json: by `model_type`, as transformers' AutoConfig dispatches (a config without
    one by its `architectures` name, the registry's key); an ArchitectureError names what is unsupported."""
    if not isinstance(config, dict):
        raise ArchitectureError(f"{where}: not a JSON object of model settings; it is a {type(config).__name__}")
    model_type = config.get("model_type")
    supported = ", ".join(_BY_MODEL_TYPE)
    if model_type is not None and not isinstance(model_type, str):
        raise ArchitectureError(f"{where}: field 'model_type'={model_type!r} is not a string; supported: {supported}")
    if model_type in UNSUPPORTED_MODEL_TYPES:
        raise ArchitectureError(f"{where}: model_type '{model_type}': {UNSUPPORTED_MODEL_TYPES[model_type]}; "
                                f"supported: {supported}")
    if model_type is None:
        names = [REGISTRY[n] for n in config.get("architectures") or () if n in REGISTRY]
        if names:
            return names[0]
    if model_type not in _BY_MODEL_TYPE:
        raise ArchitectureError(f"{where}: model_type {model_type!r} is not supported; supported: {supported} "
                                f"(architectures {', '.join(REGISTRY)})")
    return _BY_MODEL_TYPE[model_type]


__all__ = ["FAMILIES", "REGISTRY", "UNSUPPORTED_MODEL_TYPES", "Architecture", "ArchitectureError", "DecodeSpec",
           "ModelFamily", "NameMap", "RematSupport", "TunixPatches", "Unsupported", "VllmSupport", "VllmTpuSupport",
           "family_for_hf_config", "family_named", "family_of"]
