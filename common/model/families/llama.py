"""Llama 3.x (Hugging Face `LlamaForCausalLM`, model_type `llama`) on Tunix's Llama 3 module.

Tunix's Llama has no biases (attention_bias/mlp_bias are refused) and no dtype setting (policy.py casts its
parameters); its attention applies RoPE with base 1e6 whatever the config says and lacks Llama 3.1's frequency
scaling, hence the rope patch (architectures.rope_of).
"""

from __future__ import annotations

import functools
from typing import Any

from grpo_stream.common.model.families import llama_like
from grpo_stream.common.model.families.record import (Architecture, DecodeSpec, ModelFamily, NameMap, RematSupport,
                                                       TunixPatches, VllmSupport, VllmTpuSupport)

MODULE = "tunix.models.llama3.model"


def _tunix_config(arch: Architecture, dtype: Any) -> Any:
    from tunix.models.llama3 import model as llama3  # noqa: PLC0415 - deferred: a Llama model only

    return llama3.ModelConfig(**llama_like.tunix_kwargs(arch), weight_tying=arch.tied_embeddings)


LLAMA3 = ModelFamily(
    family="llama3", hf_architecture="LlamaForCausalLM", hf_model_type="llama",
    parse_hf_config=functools.partial(llama_like.parse, family="llama3", code="Llama",
                                      refused_biases=("attention_bias", "mlp_bias"), scalings=("llama3",)),
    hf_config_fields=llama_like.hf_config_fields,
    tunix_module=MODULE, tunix_class="Llama3", tunix_config=_tunix_config,
    names=NameMap(from_hf=llama_like.hf_rules, to_hf=llama_like.to_hf),
    decode=DecodeSpec(layout="llama"),
    remat=RematSupport(),
    tunix_patches=TunixPatches(rope=True, shard_modules=(MODULE,), remat_policy=True),
    vllm=VllmSupport("LlamaForCausalLM"),
    vllm_tpu=VllmTpuSupport("tunix.models.llama3.mapping_vllm_jax"),
    # untied, with Llama 3.1's RoPE scaling: the family's harder paths
    tiny_hf_config={**llama_like.TINY_SHAPE, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
)
