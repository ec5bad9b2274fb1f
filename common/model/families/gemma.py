"""Gemma 2 (`Gemma2ForCausalLM`, model_type `gemma2`) and Gemma 3 text (`Gemma3ForCausalLM`, `gemma3_text`) on
Tunix's Gemma and Gemma 3 modules, within the constants those modules fix (checked, not assumed: a config outside
them is refused naming the field).

Tunix stacks q, k and v into einsum tensors ([3, heads, embed, head_dim] when heads == KV heads, else q_einsum and
kv_einsum), so the Hugging Face tensors are read under pending names and assembled (`NameMap.assemble`). Gemma 3's
model code calls `tunix.utils.sharding_utils.shard`, Gemma 2's its own module's. Neither is wired for rematerialisation
or vllm-tpu (their records say why).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from grpo_stream.common.model.families import llama_like
from grpo_stream.common.model.families.record import (Architecture, ArchitectureError, DecodeSpec, HfRule,
                                                       ModelFamily, NameMap, TunixPatches, Unsupported, VllmSupport,
                                                       check_heads, family_named, field, flag, mapping, rope_theta)

GEMMA2_MODULE, GEMMA3_MODULE = "tunix.models.gemma.model", "tunix.models.gemma3.model"
PENDING_QKV = r"\.attn\._[qkv]$"  # q/k/v read but not yet assembled
_SLIDING, _FULL = "sliding_attention", "full_attention"
# what transformers' Gemma2Config / Gemma3TextConfig take when config.json leaves a field out (a config written by
# transformers names them all; a hand-written or stripped one may not, and must mean what transformers computes)
_GEMMA2_DEFAULTS = {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                    "sliding_window": 4096, "head_dim": 256}
_GEMMA3_DEFAULTS = {"query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
                    "head_dim": 256}


def _given(config: dict, key: str, defaults: dict):
    """config[key], null included (no cap, no window), or transformers' default when the key is absent."""
    return config[key] if key in config else defaults[key]


def _window(config: dict, defaults: dict, types: tuple, where: str) -> int | None:
    """The sliding layers' window; null only when no layer slides (transformers cannot run sliding layers without
    one, and Tunix's error would name no field)."""
    window = _given(config, "sliding_window", defaults)
    if _SLIDING in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ArchitectureError(f"{where}: sliding_window={window!r}; the sliding_attention layers need a window (a "
                                "positive number of tokens; Gemma 2 and 3 checkpoints state one)")
    return window


def _rope_type(config: dict, where: str) -> str:
    """The RoPE scaling type config.json asks for (rope_scaling, or transformers 5's rope_parameters)."""
    scaling = mapping(config, "rope_scaling", where) or mapping(config, "rope_parameters", where)
    return scaling.get("rope_type", scaling.get("type", "default"))


def parse_gemma2(config: dict, where: str) -> Architecture:
    """Gemma 2, within what Tunix's Gemma code computes (its constants are checked, not assumed)."""
    head_dim = field(config, "head_dim", where, default=_GEMMA2_DEFAULTS["head_dim"])
    fixed = {"query_pre_attn_scalar": (_given(config, "query_pre_attn_scalar", _GEMMA2_DEFAULTS), head_dim),
             "rope_theta": (rope_theta(config, where), 10000.0),
             # transformers applies a scaling (linear, dynamic, ...) here; Tunix's Gemma 2 RoPE has none
             "rope_type": (_rope_type(config, where), "default"),
             "rms_norm_eps": (float(config.get("rms_norm_eps", 1e-6)), 1e-6),
             "hidden_activation": (config.get("hidden_activation", "gelu_pytorch_tanh"), "gelu_pytorch_tanh"),
             "tie_word_embeddings": (flag(config, "tie_word_embeddings", where, True), True),
             # q/k/v/o biases, which Tunix's Gemma has no weights for
             "attention_bias": (bool(config.get("attention_bias")), False),
             # transformers' sdpa attention (its default) then lets every token see the ones after it
             "use_bidirectional_attention": (bool(config.get("use_bidirectional_attention")), False)}
    for key, (got, want) in fixed.items():
        if got != want:
            raise ArchitectureError(f"{where}: {key}={got!r}; Tunix's Gemma 2 code fixes it to {want!r} "
                                    "(Gemma 2 2B and 9B checkpoints match; 27B's query_pre_attn_scalar does not)")
    layers = field(config, "num_hidden_layers", where)
    types = tuple(config.get("layer_types") or [_SLIDING if i % 2 == 0 else _FULL for i in range(layers)])
    if len(types) != layers or set(types) - {_SLIDING, _FULL}:
        raise ArchitectureError(f"{where}: layer_types must list sliding_attention/full_attention per layer")
    heads = field(config, "num_attention_heads", where)
    return check_heads(Architecture(
        family="gemma2", vocab_size=field(config, "vocab_size", where), num_layers=layers,
        embed_dim=field(config, "hidden_size", where), hidden_dim=field(config, "intermediate_size", where),
        num_heads=heads, num_kv_heads=field(config, "num_key_value_heads", where, default=heads), head_dim=head_dim,
        norm_eps=1e-6, rope_theta=10000.0, tied_embeddings=True,
        max_position_embeddings=field(config, "max_position_embeddings", where, default=8192),
        attn_softcap=_given(config, "attn_logit_softcapping", _GEMMA2_DEFAULTS),
        final_softcap=_given(config, "final_logit_softcapping", _GEMMA2_DEFAULTS),
        sliding_window=_window(config, _GEMMA2_DEFAULTS, types, where), layer_types=types), where)


def parse_gemma3(config: dict, where: str) -> Architecture:
    """Gemma 3 text, within what Tunix's Gemma 3 code computes (5 sliding : 1 full layers, no soft caps)."""
    head_dim = field(config, "head_dim", where, default=_GEMMA3_DEFAULTS["head_dim"])
    embed = field(config, "hidden_size", where)
    heads, layers = field(config, "num_attention_heads", where), field(config, "num_hidden_layers", where)
    scalar = float(_given(config, "query_pre_attn_scalar", _GEMMA3_DEFAULTS))
    checks = {"rms_norm_eps": (float(config.get("rms_norm_eps", 1e-6)), [1e-6]),
              "hidden_activation": (config.get("hidden_activation", "gelu_pytorch_tanh"), ["gelu_pytorch_tanh"]),
              "attn_logit_softcapping": (config.get("attn_logit_softcapping"), [None]),
              "final_logit_softcapping": (config.get("final_logit_softcapping"), [None]),
              "tie_word_embeddings": (flag(config, "tie_word_embeddings", where, True), [True]),
              "attention_bias": (bool(config.get("attention_bias")), [False]),
              # EmbeddingGemma's: every token attends to the ones after it too; Tunix's Gemma 3 is causal
              "use_bidirectional_attention": (bool(config.get("use_bidirectional_attention")), [False]),
              "query_pre_attn_scalar": (scalar, [float(head_dim), float(embed // heads)])}
    for key, (got, allowed) in checks.items():
        if got not in allowed:
            raise ArchitectureError(f"{where}: {key}={got!r}; Tunix's Gemma 3 code supports only {allowed}")
    pattern = tuple(_FULL if (i + 1) % 6 == 0 else _SLIDING for i in range(layers))
    every = int(_given(config, "sliding_window_pattern", _GEMMA3_DEFAULTS))  # as transformers lays them out
    types = tuple(config.get("layer_types") or (_FULL if (i + 1) % every == 0 else _SLIDING for i in range(layers)))
    if types != pattern:
        raise ArchitectureError(f"{where}: layer_types must be 5 sliding_attention layers then one full_attention, "
                                "repeated (Tunix's Gemma 3 layout)")
    params = mapping(config, "rope_parameters", where)
    # as Gemma3TextConfig reads them: an (older) rope_scaling updates rope_parameters' full_attention entry
    full = {**mapping(params, _FULL, f"{where}: rope_parameters"), **mapping(config, "rope_scaling", where)}
    local = mapping(params, _SLIDING, f"{where}: rope_parameters")
    theta = field({"rope_theta": full.get("rope_theta", config.get("rope_theta"))}, "rope_theta", where, float,
                  1_000_000.0)
    local_theta = field({"rope_theta": local.get("rope_theta", config.get("rope_local_base_freq"))}, "rope_theta",
                        f"{where}: sliding_attention", float, 10000.0)
    kind = full.get("rope_type", full.get("type", "default"))
    if kind not in ("default", "linear") or local.get("rope_type", "default") != "default":
        raise ArchitectureError(f"{where}: rope type {kind!r}; Gemma 3 supports default and linear scaling")
    return check_heads(Architecture(
        family="gemma3", vocab_size=field(config, "vocab_size", where), num_layers=layers, embed_dim=embed,
        hidden_dim=field(config, "intermediate_size", where), num_heads=heads,
        num_kv_heads=field(config, "num_key_value_heads", where, default=heads), head_dim=head_dim, norm_eps=1e-6,
        rope_theta=theta, tied_embeddings=True,
        max_position_embeddings=field(config, "max_position_embeddings", where, default=32768),
        sliding_window=_window(config, _GEMMA3_DEFAULTS, types, where), layer_types=types,
        rope_local_theta=local_theta,
        rope_linear_factor=field(full, "factor", f"{where}: rope scaling", float, 1.0) if kind == "linear" else 1.0,
        query_pre_attn_scalar=scalar), where)


def gemma2_hf_fields(arch: Architecture) -> dict:
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": arch.head_dim, "attention_bias": False,
            "attn_logit_softcapping": arch.attn_softcap, "final_logit_softcapping": arch.final_softcap,
            "sliding_window": arch.sliding_window, "layer_types": list(arch.layer_types)}


def gemma3_hf_fields(arch: Architecture) -> dict:
    full = ({"rope_type": "linear", "factor": arch.rope_linear_factor} if arch.rope_linear_factor != 1
            else {"rope_type": "default"})
    fields = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": int(arch.query_pre_attn_scalar),
              "sliding_window": arch.sliding_window, "layer_types": list(arch.layer_types),
              "rope_parameters": {_FULL: {**full, "rope_theta": arch.rope_theta},
                                  _SLIDING: {"rope_type": "default", "rope_theta": arch.rope_local_theta}},
              # the same RoPE in the keys transformers 4 reads, so older loaders (and vLLM builds on them) agree
              "rope_local_base_freq": arch.rope_local_theta}
    if arch.rope_linear_factor != 1:
        fields["rope_scaling"] = {"rope_type": "linear", "factor": arch.rope_linear_factor}
    return fields


def _norms(post_attn_norm: str) -> dict[str, str]:
    """HF layer norm name -> Tunix module name (Gemma 2 and 3 name the post-attention norm differently)."""
    return {"input_layernorm": "pre_attention_norm", "post_attention_layernorm": post_attn_norm,
            "pre_feedforward_layernorm": "pre_ffw_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _spec(arch: Architecture) -> DecodeSpec:
    return family_named(arch.family).decode


def hf_rules(arch: Architecture) -> list[HfRule]:
    e, h, d = arch.embed_dim, arch.num_heads, arch.head_dim
    layer = r"model\.layers\.(\d+)\."
    qk_norms = [(layer + r"self_attn\.q_norm\.weight", "layers.{0}.attn._query_norm.scale", lambda w: w),
                (layer + r"self_attn\.k_norm\.weight", "layers.{0}.attn._key_norm.scale", lambda w: w)]
    norms = _norms(_spec(arch).post_attn_norm)
    return [*(qk_norms if _spec(arch).qk_norm else []),
            (r"model\.embed_tokens\.weight", "embedder.input_embedding", lambda w: w),
            (r"model\.norm\.weight", "final_norm.scale", lambda w: w),
            # q/k/v under pending names until all three are read (assemble): [heads, embed, head_dim]
            (layer + r"self_attn\.(q|k|v)_proj\.weight", "layers.{0}.attn._{1}",
             lambda w: w.reshape(-1, d, e).transpose(0, 2, 1)),
            (layer + r"self_attn\.o_proj\.weight", "layers.{0}.attn.attn_vec_einsum.w", lambda w: w.T.reshape(h, d, e)),
            (layer + r"mlp\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.{1}_proj.kernel", lambda w: w.T),
            *[(layer + hf + r"\.weight", "layers.{0}." + ours + ".scale", lambda w: w) for hf, ours in norms.items()]]


def assemble(named: dict[str, np.ndarray], arch: Architecture) -> dict[str, np.ndarray]:
    """Per-layer q, k, v -> Tunix's qkv_einsum [3, N, E, H] (when heads == kv heads) or q_einsum + kv_einsum."""
    pending = re.compile(PENDING_QKV)
    out = {k: v for k, v in named.items() if not pending.search(k)}
    for i in range(arch.num_layers):
        parts = [named.get(f"layers.{i}.attn._{x}") for x in "qkv"]
        if any(p is None for p in parts):
            continue  # reported as missing parameters by the caller
        stacked = parts if arch.num_heads == arch.num_kv_heads else parts[1:]  # the tensors np.stack joins
        if len({p.shape for p in stacked}) > 1:
            # np.stack's own error names no tensor; read_named turns this into a CheckpointError
            shapes = ", ".join(f"model.layers.{i}.self_attn.{x}_proj.weight {list(p.shape)}"
                               for x, p in zip("qkv", parts))
            raise ValueError(f"layer {i}: q/k/v projections disagree in shape ([heads, hidden, head_dim]: {shapes}); "
                             "config.json's num_attention_heads/num_key_value_heads/head_dim do not describe them")
        if arch.num_heads == arch.num_kv_heads:
            out[f"layers.{i}.attn.qkv_einsum.w"] = np.stack(parts)
        else:
            out[f"layers.{i}.attn.q_einsum.w"] = parts[0]
            out[f"layers.{i}.attn.kv_einsum.w"] = np.stack(parts[1:])
    return out


def to_hf(arch: Architecture, named: dict) -> dict:
    out, e = {}, arch.embed_dim
    to_hf_norm = {v: k for k, v in _norms(_spec(arch).post_attn_norm).items()}
    for name, w in named.items():
        parts = name.split(".")
        if name == "embedder.input_embedding":
            out["model.embed_tokens.weight"] = w
        elif name == "final_norm.scale":
            out["model.norm.weight"] = w
        elif parts[2] == "attn":
            prefix = f"model.layers.{parts[1]}.self_attn."
            if parts[3] == "attn_vec_einsum":
                out[prefix + "o_proj.weight"] = w.reshape(-1, e).T
            elif parts[3] in ("_query_norm", "_key_norm"):
                out[prefix + f"{parts[3][1]}_norm.weight"] = w
            else:
                stacked = {"q_einsum": ("q",), "kv_einsum": ("k", "v"), "qkv_einsum": ("q", "k", "v")}[parts[3]]
                tensors = [w] if parts[3] == "q_einsum" else list(w)
                for x, t in zip(stacked, tensors):  # [heads, embed, head_dim] -> [heads * head_dim, embed]
                    out[prefix + f"{x}_proj.weight"] = t.transpose(0, 2, 1).reshape(-1, e)
        elif parts[2] == "mlp":
            out[f"model.layers.{parts[1]}.mlp.{parts[3]}.weight"] = w.T
        else:
            out[f"model.layers.{parts[1]}.{to_hf_norm[parts[2]]}.weight"] = w
    return out


def _gemma2_config(arch: Architecture, dtype: Any) -> Any:
    from tunix.models.gemma import model as gemma  # noqa: PLC0415 - deferred: a Gemma 2 model only

    kinds = {_SLIDING: gemma.AttentionType.LOCAL_SLIDING, _FULL: gemma.AttentionType.GLOBAL}
    return gemma.ModelConfig(
        num_layers=arch.num_layers, num_embed=arch.vocab_size, embed_dim=arch.embed_dim, hidden_dim=arch.hidden_dim,
        num_heads=arch.num_heads, head_dim=arch.head_dim, num_kv_heads=arch.num_kv_heads,
        final_logit_softcap=arch.final_softcap, use_post_attn_norm=True, use_post_ffw_norm=True,
        attention_types=tuple(kinds[t] for t in arch.layer_types), attn_logits_soft_cap=arch.attn_softcap,
        sliding_window_size=arch.sliding_window)


def _gemma3_config(arch: Architecture, dtype: Any) -> Any:
    from tunix.models.gemma3 import model as gemma3  # noqa: PLC0415 - deferred: a Gemma 3 model only

    norm = gemma3.QueryPreAttentionNormalisation
    return gemma3.ModelConfig(
        num_layers=arch.num_layers, num_embed=arch.vocab_size, embed_dim=arch.embed_dim, hidden_dim=arch.hidden_dim,
        num_heads=arch.num_heads, head_dim=arch.head_dim, num_kv_heads=arch.num_kv_heads,
        sliding_window_size=arch.sliding_window, local_base_frequency=arch.rope_local_theta,
        global_base_frequency=arch.rope_theta, global_scale_factor=arch.rope_linear_factor, param_dtype=dtype,
        query_pre_attn_norm=(norm.BY_ONE_OVER_SQRT_HEAD_DIM if arch.query_pre_attn_scalar == arch.head_dim
                             else norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS))


_NAMES = NameMap(from_hf=hf_rules, to_hf=to_hf, pending=PENDING_QKV, assemble=assemble)
_NO_REMAT = Unsupported("grpo-stream has not wired Tunix's Gemma RematConfig (its gradients under remat are untested "
                        "here)")
_NO_VLLM_TPU = Unsupported("Tunix 0.1.7 ships no vLLM-JAX name map for Gemma 2 or Gemma 3 "
                           "(tunix.models.<family>.mapping_vllm_jax); use sampler.engine=jax on TPU")
_TINY = {**llama_like.TINY_SHAPE, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
         "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 16, "sliding_window": 4096}

GEMMA2 = ModelFamily(
    family="gemma2", hf_architecture="Gemma2ForCausalLM", hf_model_type="gemma2",
    parse_hf_config=parse_gemma2, hf_config_fields=gemma2_hf_fields,
    tunix_module=GEMMA2_MODULE, tunix_class="Gemma", tunix_config=_gemma2_config,
    names=_NAMES, decode=DecodeSpec(layout="gemma", post_attn_norm="post_attn_norm"), remat=_NO_REMAT,
    tunix_patches=TunixPatches(shard_modules=(GEMMA2_MODULE,)),
    vllm=VllmSupport("Gemma2ForCausalLM"), vllm_tpu=_NO_VLLM_TPU,
    tiny_hf_config={**_TINY, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "rope_theta": 10000.0,
                    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
)

GEMMA3 = ModelFamily(
    family="gemma3", hf_architecture="Gemma3ForCausalLM", hf_model_type="gemma3_text",
    parse_hf_config=parse_gemma3, hf_config_fields=gemma3_hf_fields,
    tunix_module=GEMMA3_MODULE, tunix_class="Gemma3", tunix_config=_gemma3_config,
    names=_NAMES, decode=DecodeSpec(layout="gemma", qk_norm=True, post_attn_norm="post_attention_norm",
                                    per_layer_rope=True),
    remat=_NO_REMAT, tunix_patches=TunixPatches(shard_modules=("tunix.utils.sharding_utils",)),
    vllm=VllmSupport("Gemma3ForCausalLM"), vllm_tpu=_NO_VLLM_TPU,
    # six layers: five sliding and one full, Tunix's Gemma 3 layout; linear scaling on the full layer
    tiny_hf_config={**_TINY, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                    "num_hidden_layers": 6,
                    "rope_parameters": {_FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                        _SLIDING: {"rope_type": "default", "rope_theta": 10000.0}}},
)
