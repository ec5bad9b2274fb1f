"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`, model_type `qwen2`) and Qwen3 dense (`Qwen3ForCausalLM`, `qwen3`) on
Tunix's Qwen2 and Qwen3 modules.

Qwen2 has q/k/v biases and reads rope_theta itself; Qwen3 normalises q and k per head and, in Tunix 0.1.7, applies
RoPE with base 1e6 whatever the config says (the rope patch, architectures.rope_of). Neither implements a RoPE scaling
or sliding windows.
"""

from __future__ import annotations

import functools
from typing import Any

from grpo_stream.common.model.families import llama_like
from grpo_stream.common.model.families.record import (Architecture, DecodeSpec, ModelFamily, NameMap, RematSupport,
                                                       TunixPatches, VllmSupport, VllmTpuSupport)

QWEN2_MODULE, QWEN3_MODULE = "tunix.models.qwen2.model", "tunix.models.qwen3.model"


def _qwen2_config(arch: Architecture, dtype: Any) -> Any:
    from tunix.models.qwen2 import model as qwen2  # noqa: PLC0415 - deferred: a Qwen2 model only

    return qwen2.ModelConfig(**llama_like.tunix_kwargs(arch), use_tied_embedding=arch.tied_embeddings, dtype=dtype,
                             param_dtype=dtype)


def _qwen3_config(arch: Architecture, dtype: Any) -> Any:
    from tunix.models.qwen3 import model as qwen3  # noqa: PLC0415 - deferred: a Qwen3 model only

    return qwen3.ModelConfig(**llama_like.tunix_kwargs(arch), use_tied_embedding=arch.tied_embeddings, dtype=dtype,
                             param_dtype=dtype)


QWEN2 = ModelFamily(
    family="qwen2", hf_architecture="Qwen2ForCausalLM", hf_model_type="qwen2",
    parse_hf_config=functools.partial(llama_like.parse, family="qwen2", code="Qwen2"),
    hf_config_fields=llama_like.hf_config_fields,
    tunix_module=QWEN2_MODULE, tunix_class="Qwen2", tunix_config=_qwen2_config,
    names=NameMap(from_hf=llama_like.hf_rules, to_hf=llama_like.to_hf),
    decode=DecodeSpec(layout="llama", qkv_bias=True),
    remat=RematSupport(),
    tunix_patches=TunixPatches(shard_modules=(QWEN2_MODULE,), remat_policy=True),
    vllm=VllmSupport("Qwen2ForCausalLM"),
    vllm_tpu=VllmTpuSupport("tunix.models.qwen2.mapping_vllm_jax"),
    tiny_hf_config={**llama_like.TINY_SHAPE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
                    "use_sliding_window": False},
)

QWEN3 = ModelFamily(
    family="qwen3", hf_architecture="Qwen3ForCausalLM", hf_model_type="qwen3",
    # Qwen3Config's head_dim is 128 when config.json has none, not hidden_size / num_attention_heads
    parse_hf_config=functools.partial(llama_like.parse, family="qwen3", code="Qwen3",
                                      refused_biases=("attention_bias",), head_dim_default=128),
    hf_config_fields=llama_like.hf_config_fields,
    tunix_module=QWEN3_MODULE, tunix_class="Qwen3", tunix_config=_qwen3_config,
    names=NameMap(from_hf=llama_like.hf_rules, to_hf=llama_like.to_hf),
    decode=DecodeSpec(layout="llama", qk_norm=True),
    remat=RematSupport(),
    tunix_patches=TunixPatches(rope=True, shard_modules=(QWEN3_MODULE,), remat_policy=True),
    vllm=VllmSupport("Qwen3ForCausalLM"),
    vllm_tpu=VllmTpuSupport("tunix.models.qwen3.mapping_vllm_jax"),
    # a RoPE base other than Tunix's fixed 1e6, so the rope patch shows in the logits
    tiny_hf_config={**llama_like.TINY_SHAPE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                    "rms_norm_eps": 1e-6, "rope_theta": 5000000.0, "tie_word_embeddings": False,
                    "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
)
