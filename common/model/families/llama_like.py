"""The decoder Llama 3, Qwen2 and Qwen3 share (pre-norm RMSNorm, SiLU-gated MLP, grouped-query attention, RoPE on
split halves, Tunix modules named alike): config.json parsing, the Hugging Face name map and the Tunix config.

What differs between the three is data in their records (llama.py, qwen.py): the biases a family's Tunix code lacks,
the RoPE scalings it implements, Qwen2's q/k/v biases and Qwen3's q/k norms (`DecodeSpec`).
"""

from __future__ import annotations

import re
from typing import Any

from grpo_stream.common.model.families.record import (Architecture, ArchitectureError, HfRule, check_heads, field,
                                                       flag, mapping, rope_theta)

LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def parse(config: dict, where: str, *, family: str, code: str, refused_biases: tuple[str, ...] = (),
          scalings: tuple[str, ...] = (), head_dim_default: int | None = None) -> Architecture:
    """The Architecture of a Llama-like config.json. `refused_biases`: bias flags the family's Tunix code (named
    `code` in messages) has no weights for; `scalings`: the rope_scaling types beyond none it implements;
    `head_dim_default`: the head_dim transformers' config class takes when config.json has none (None:
    hidden_size // num_attention_heads)."""
    heads = field(config, "num_attention_heads", where)
    embed = field(config, "hidden_size", where)
    head_dim = field(config, "head_dim", where, default=head_dim_default or (embed // heads if heads else None))
    if config.get("hidden_act", "silu") != "silu":
        raise ArchitectureError(f"{where}: hidden_act={config['hidden_act']!r}; the {family} model code uses silu")
    set_biases = [key for key in refused_biases if config.get(key)]
    if set_biases:
        raise ArchitectureError(f"{where}: {'/'.join(set_biases)}=true; Tunix's {code} has no such biases")
    if config.get("use_sliding_window"):
        raise ArchitectureError(f"{where}: use_sliding_window=true is not supported; set it false (Qwen2.5 and "
                                "Qwen3 ship it false)")
    arch = Architecture(
        family=family, vocab_size=field(config, "vocab_size", where),
        num_layers=field(config, "num_hidden_layers", where), embed_dim=embed,
        hidden_dim=field(config, "intermediate_size", where), num_heads=heads,
        num_kv_heads=field(config, "num_key_value_heads", where, default=heads), head_dim=head_dim,
        norm_eps=field(config, "rms_norm_eps", where, float), rope_theta=rope_theta(config, where),
        tied_embeddings=flag(config, "tie_word_embeddings", where, False),
        rope_scaling=_rope_scaling(config, family, scalings, where),
        max_position_embeddings=field(config, "max_position_embeddings", where, default=32768))
    return check_heads(arch, where)


def _rope_scaling(config: dict, family: str, scalings: tuple[str, ...], where: str) -> tuple:
    scaling, params = mapping(config, "rope_scaling", where), mapping(config, "rope_parameters", where)
    if not scaling and params.get("rope_type", "default") != "default":
        scaling = params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return ()
    if kind == "llama3" and "llama3" in scalings:
        missing = [k for k in LLAMA3_SCALING_KEYS if k not in scaling]
        if missing:
            raise ArchitectureError(f"{where}: rope_scaling of type llama3 lacks {missing}")
        return tuple(sorted((k, field(scaling, k, f"{where}: rope_scaling", float)) for k in LLAMA3_SCALING_KEYS))
    raise ArchitectureError(f"{where}: rope_scaling type {kind!r} is not supported for {family} (supported: none"
                            f"{''.join(f', {s!r}' for s in scalings)}); remove rope_scaling to run without it")


def hf_config_fields(arch: Architecture) -> dict:
    """The fields of config.json beyond the shapes every family writes."""
    fields: dict[str, Any] = {"hidden_act": "silu", "attention_bias": arch.qkv_bias, "use_sliding_window": False}
    if arch.rope_scaling:
        scaling = {"rope_type": "llama3", **dict(arch.rope_scaling)}
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
        fields["rope_scaling"] = scaling
    return fields


def hf_rules(arch: Architecture) -> list[HfRule]:
    """(HF name pattern, our name, HF array -> our layout) for every tensor of a Llama-like model."""
    e, h, kv, d = arch.embed_dim, arch.num_heads, arch.num_kv_heads, arch.head_dim
    layer = r"model\.layers\.(\d+)\."

    def attn(heads):
        return lambda w: w.T.reshape(e, heads, d)  # [heads * head_dim, embed] -> [embed, heads, head_dim]
    rules = [
        (r"model\.embed_tokens\.weight", "embedder.input_embedding", lambda w: w),
        (r"model\.norm\.weight", "final_norm.w", lambda w: w),
        (r"lm_head\.weight", "lm_head.w", lambda w: w.T),
        (layer + r"self_attn\.q_proj\.weight", "layers.{0}.attn.q_proj.w", attn(h)),
        (layer + r"self_attn\.k_proj\.weight", "layers.{0}.attn.k_proj.w", attn(kv)),
        (layer + r"self_attn\.v_proj\.weight", "layers.{0}.attn.v_proj.w", attn(kv)),
        (layer + r"self_attn\.o_proj\.weight", "layers.{0}.attn.o_proj.w", lambda w: w.T.reshape(h, d, e)),
        (layer + r"mlp\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.{1}_proj.kernel", lambda w: w.T),
        (layer + r"(input_layernorm|post_attention_layernorm)\.weight", "layers.{0}.{1}.w", lambda w: w),
    ]
    if arch.qk_norm:
        rules.append((layer + r"self_attn\.(q|k)_norm\.weight", "layers.{0}.attn.{1}_norm.w", lambda w: w))
    if arch.qkv_bias:
        rules.append((layer + r"self_attn\.(q|k|v)_proj\.bias", "layers.{0}.attn.{1}_bias", lambda w: w))
    return rules


_LAYER = re.compile(r"layers\.(\d+)\.(.+)$")


def to_hf(arch: Architecture, named: dict) -> dict:
    """The inverse of `hf_rules`: HF names and [out, in] layouts."""
    out = {}
    for name, w in named.items():
        if name in _GLOBALS:
            hf_name, layout = _GLOBALS[name]
            out[hf_name] = layout(w)
            continue
        match = _LAYER.match(name)
        hf = _layer_to_hf(match.group(2), w) if match else None
        if hf is None:
            raise ValueError(f"parameter {name} has no Hugging Face name for {arch.family}")
        out[f"model.layers.{match.group(1)}.{hf[0]}"] = hf[1]
    return out


_GLOBALS = {"embedder.input_embedding": ("model.embed_tokens.weight", lambda w: w),
            "final_norm.w": ("model.norm.weight", lambda w: w), "lm_head.w": ("lm_head.weight", lambda w: w.T)}


def _layer_to_hf(rest: str, w: Any) -> tuple[str, Any] | None:
    """(HF name within the layer, array in HF layout) of one of a layer's parameters ('attn.q_proj.w', ...)."""
    parts = rest.split(".")
    if parts[0] == "attn" and parts[1].endswith("_proj"):
        flat = w.reshape(w.shape[0] * w.shape[1], -1) if parts[1] == "o_proj" else w.reshape(w.shape[0], -1)
        return f"self_attn.{parts[1]}.weight", flat.T
    if parts[0] == "attn" and parts[1].endswith("_norm"):
        return f"self_attn.{parts[1]}.weight", w
    if parts[0] == "attn" and parts[1].endswith("_bias"):
        return f"self_attn.{parts[1][0]}_proj.bias", w
    if parts[0] == "mlp":
        return f"mlp.{parts[1]}.weight", w.T
    if parts[0] in ("input_layernorm", "post_attention_layernorm"):
        return f"{parts[0]}.weight", w
    return None


def tunix_kwargs(arch: Architecture) -> dict:
    """The ModelConfig arguments the Llama 3, Qwen2 and Qwen3 modules share."""
    return dict(num_layers=arch.num_layers, vocab_size=arch.vocab_size, embed_dim=arch.embed_dim,
                hidden_dim=arch.hidden_dim, num_heads=arch.num_heads, head_dim=arch.head_dim,
                num_kv_heads=arch.num_kv_heads, rope_theta=arch.rope_theta, norm_eps=arch.norm_eps)


# a config.json small enough for a test to build the model in a second; the family records add their own fields
TINY_SHAPE = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256}
