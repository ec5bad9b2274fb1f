"""Model architectures: a Hugging Face `config.json` mapped to Tunix's model code, and RoPE done right.

`Architecture` is what grpo-stream needs to know of a decoder (read from a
checkpoint's `config.json`, or built for the tiny demo model); `tunix_config`
turns it into the Tunix family's `ModelConfig` (nothing in Tunix 0.1.7 does
this). Supported families: Llama 3.x (`llama`), Qwen2/Qwen2.5 (`qwen2`),
Qwen3 dense (`qwen3`), Gemma 2 (`gemma2`) and Gemma 3 text (`gemma3_text`),
the Gemmas within the constants Tunix's Gemma code fixes (checked, not assumed). A config using a feature Tunix's model code lacks is
refused with the field named, never silently approximated.

RoPE: Tunix 0.1.7's Llama 3 and Qwen3 attention apply RoPE with base 1e6
whatever the config says, and nothing implements Llama 3.1's frequency
scaling. Those two modules' `apply_rope` is replaced (once per process) by
one that, while a model is traced inside `rope_of(arch)` (as
`PolicyModel.apply` does), uses that architecture's frequencies
(`rope_timescale`, the numbers `transformers` computes), so Llama 3.1 (base
500000, `llama3` scaling) and Qwen3 checkpoints with any base give the right
logits. Outside `rope_of` the original runs unchanged, so several models
with different settings can share a process.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any

import jax.numpy as jnp

FAMILIES = {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",  # HF model_type -> ours
            "gemma3_text": "gemma3"}
_UNSUPPORTED = {
    "gemma": "Gemma 1 is not supported",
    "gemma3": "multimodal Gemma 3 checkpoints are not supported; use a text-only one (model_type gemma3_text)",
    "qwen3_moe": "Qwen3 mixture-of-experts is not supported yet",
}


class ArchitectureError(ValueError):
    """A checkpoint's config that grpo-stream cannot run, phrased with the field and the fix."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    family: str                  # llama3 | qwen2 | qwen3 | gemma2 | gemma3
    vocab_size: int
    num_layers: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    tied_embeddings: bool
    rope_scaling: tuple = ()     # llama3 scaling as sorted (key, value) pairs; () = none
    max_position_embeddings: int = 32768
    # Gemma 2 only
    attn_softcap: float | None = None    # attention logits: cap * tanh(logits / cap)
    final_softcap: float | None = None   # output logits, the same
    sliding_window: int | None = None    # window of the layers marked sliding
    layer_types: tuple = ()              # per layer: "sliding_attention" | "full_attention"
    # Gemma 3 only
    rope_local_theta: float = 10000.0    # RoPE base of the sliding layers (rope_theta is the full layers')
    rope_linear_factor: float = 1.0      # full layers' linear RoPE scaling
    query_pre_attn_scalar: float = 0.0   # attention scale is query_pre_attn_scalar ** -0.5 (0: head_dim)

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"


def _field(config: dict, key: str, where: str, kind=int, default: Any = None):
    value = config.get(key, default)
    if value is None:
        raise ArchitectureError(f"{where}: field '{key}' is missing")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ArchitectureError(f"{where}: field '{key}'={value!r} is not a {kind.__name__}") from None


def from_hf_config(config: dict, where: str = "config.json") -> Architecture:
    """The architecture a Hugging Face `config.json` (parsed) describes; errors name the field."""
    model_type = config.get("model_type")
    if model_type in _UNSUPPORTED:
        raise ArchitectureError(f"{where}: model_type '{model_type}': {_UNSUPPORTED[model_type]}; supported: "
                                f"{', '.join(FAMILIES)}")
    if model_type not in FAMILIES:
        raise ArchitectureError(f"{where}: model_type {model_type!r} is not supported; supported: "
                                f"{', '.join(FAMILIES)}")
    family = FAMILIES[model_type]
    if family == "gemma2":
        return _gemma2(config, where)
    if family == "gemma3":
        return _gemma3(config, where)
    heads = _field(config, "num_attention_heads", where)
    embed = _field(config, "hidden_size", where)
    head_dim = _field(config, "head_dim", where, default=embed // heads if heads else None)
    if config.get("hidden_act", "silu") != "silu":
        raise ArchitectureError(f"{where}: hidden_act={config['hidden_act']!r}; the {family} model code uses silu")
    if family == "llama3" and (config.get("attention_bias") or config.get("mlp_bias")):
        raise ArchitectureError(f"{where}: attention_bias/mlp_bias are true; Tunix's Llama has no biases")
    if config.get("use_sliding_window"):
        raise ArchitectureError(f"{where}: use_sliding_window=true is not supported; set it false (Qwen2.5 and "
                                "Qwen3 ship it false)")
    if family == "qwen3" and config.get("attention_bias"):
        raise ArchitectureError(f"{where}: attention_bias=true; Tunix's Qwen3 has no attention biases")
    scaling = _rope_scaling(config, family, where)
    tied = bool(config.get("tie_word_embeddings", False))
    arch = Architecture(
        family=family, vocab_size=_field(config, "vocab_size", where), num_layers=_field(config, "num_hidden_layers",
                                                                                         where),
        embed_dim=embed, hidden_dim=_field(config, "intermediate_size", where), num_heads=heads,
        num_kv_heads=_field(config, "num_key_value_heads", where, default=heads), head_dim=head_dim,
        norm_eps=_field(config, "rms_norm_eps", where, float), rope_theta=_rope_theta(config, where),
        tied_embeddings=tied, rope_scaling=scaling,
        max_position_embeddings=_field(config, "max_position_embeddings", where, default=32768))
    if arch.num_heads % arch.num_kv_heads:
        raise ArchitectureError(f"{where}: num_key_value_heads={arch.num_kv_heads} must divide "
                                f"num_attention_heads={arch.num_heads}")
    return arch


def _gemma2(config: dict, where: str) -> Architecture:
    """Gemma 2, within what Tunix's Gemma code computes (its constants are checked, not assumed)."""
    head_dim = _field(config, "head_dim", where)
    fixed = {"query_pre_attn_scalar": (config.get("query_pre_attn_scalar", head_dim), head_dim),
             "rope_theta": (_rope_theta(config, where), 10000.0),
             "rms_norm_eps": (float(config.get("rms_norm_eps", 1e-6)), 1e-6),
             "hidden_activation": (config.get("hidden_activation", "gelu_pytorch_tanh"), "gelu_pytorch_tanh"),
             "tie_word_embeddings": (bool(config.get("tie_word_embeddings", True)), True)}
    for key, (got, want) in fixed.items():
        if got != want:
            raise ArchitectureError(f"{where}: {key}={got!r}; Tunix's Gemma 2 code fixes it to {want!r} "
                                    "(Gemma 2 2B and 9B checkpoints match; 27B's query_pre_attn_scalar does not)")
    layers = _field(config, "num_hidden_layers", where)
    types = tuple(config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                                for i in range(layers)])
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ArchitectureError(f"{where}: layer_types must list sliding_attention/full_attention per layer")
    heads = _field(config, "num_attention_heads", where)
    return Architecture(
        family="gemma2", vocab_size=_field(config, "vocab_size", where), num_layers=layers,
        embed_dim=_field(config, "hidden_size", where), hidden_dim=_field(config, "intermediate_size", where),
        num_heads=heads, num_kv_heads=_field(config, "num_key_value_heads", where, default=heads), head_dim=head_dim,
        norm_eps=1e-6, rope_theta=10000.0, tied_embeddings=True,
        max_position_embeddings=_field(config, "max_position_embeddings", where, default=8192),
        attn_softcap=config.get("attn_logit_softcapping"), final_softcap=config.get("final_logit_softcapping"),
        sliding_window=config.get("sliding_window"), layer_types=types)


def _gemma3(config: dict, where: str) -> Architecture:
    """Gemma 3 text, within what Tunix's Gemma 3 code computes (5 sliding : 1 full layers, no soft caps)."""
    head_dim, embed = _field(config, "head_dim", where), _field(config, "hidden_size", where)
    heads, layers = _field(config, "num_attention_heads", where), _field(config, "num_hidden_layers", where)
    scalar = float(config.get("query_pre_attn_scalar", head_dim))
    checks = {"rms_norm_eps": (float(config.get("rms_norm_eps", 1e-6)), [1e-6]),
              "hidden_activation": (config.get("hidden_activation", "gelu_pytorch_tanh"), ["gelu_pytorch_tanh"]),
              "attn_logit_softcapping": (config.get("attn_logit_softcapping"), [None]),
              "final_logit_softcapping": (config.get("final_logit_softcapping"), [None]),
              "tie_word_embeddings": (bool(config.get("tie_word_embeddings", True)), [True]),
              "query_pre_attn_scalar": (scalar, [float(head_dim), float(embed // heads)])}
    for key, (got, allowed) in checks.items():
        if got not in allowed:
            raise ArchitectureError(f"{where}: {key}={got!r}; Tunix's Gemma 3 code supports only {allowed}")
    pattern = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers))
    types = tuple(config.get("layer_types") or pattern)
    if types != pattern:
        raise ArchitectureError(f"{where}: layer_types must be 5 sliding_attention layers then one full_attention, "
                                "repeated (Tunix's Gemma 3 layout)")
    params = config.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    theta = float(full.get("rope_theta", config.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", config.get("rope_local_base_freq", 10000.0)))
    scaling = full or config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear") or local.get("rope_type", "default") != "default":
        raise ArchitectureError(f"{where}: rope type {kind!r}; Gemma 3 supports default and linear scaling")
    return Architecture(
        family="gemma3", vocab_size=_field(config, "vocab_size", where), num_layers=layers, embed_dim=embed,
        hidden_dim=_field(config, "intermediate_size", where), num_heads=heads,
        num_kv_heads=_field(config, "num_key_value_heads", where, default=heads), head_dim=head_dim, norm_eps=1e-6,
        rope_theta=theta, tied_embeddings=True,
        max_position_embeddings=_field(config, "max_position_embeddings", where, default=32768),
        sliding_window=config.get("sliding_window"), layer_types=types, rope_local_theta=local_theta,
        rope_linear_factor=float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0,
        query_pre_attn_scalar=scalar)


def _rope_theta(config: dict, where: str) -> float:
    # transformers 5 moved the base into rope_parameters; older configs have rope_theta at the top
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ArchitectureError(f"{where}: field 'rope_theta' is missing")
    return float(theta)


def _rope_scaling(config: dict, family: str, where: str) -> tuple:
    scaling = config.get("rope_scaling") or {}
    params = config.get("rope_parameters") or {}
    if not scaling and params.get("rope_type", "default") != "default":
        scaling = params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return ()
    if kind == "llama3" and family == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise ArchitectureError(f"{where}: rope_scaling of type llama3 lacks {missing}")
        return tuple(sorted((k, float(scaling[k])) for k in keys))
    raise ArchitectureError(f"{where}: rope_scaling type {kind!r} is not supported for {family} (supported: none, "
                            "and 'llama3' for Llama); remove rope_scaling to run without it")


def gemma3_timescales(arch: Architecture) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(sliding layers', full layers') RoPE timescales of Gemma 3; linear scaling folded into the full layers'."""
    fraction = 2 * jnp.arange(0, arch.head_dim // 2) / arch.head_dim
    return (jnp.float32(arch.rope_local_theta) ** fraction,
            jnp.float32(arch.rope_theta) ** fraction * arch.rope_linear_factor)


def rope_timescale(arch: Architecture) -> jnp.ndarray:
    """RoPE wavelengths / 2 pi per frequency [head_dim / 2] (angle = position / timescale), float32.

    Unscaled, this is exactly Tunix's own computation (so the tiny model's
    numerics do not move); with Llama 3.1 scaling, the inverse of the inverse
    frequencies `transformers` computes.
    """
    d = arch.head_dim
    timescale = jnp.float32(arch.rope_theta) ** (2 * jnp.arange(0, d // 2, dtype=jnp.float32) / d)
    if not arch.rope_scaling:
        return timescale
    s = dict(arch.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    inv = 1.0 / timescale
    wavelen = 2 * math.pi / inv
    scaled = jnp.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return 1.0 / jnp.where(medium, smoothed, scaled)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, timescale: jnp.ndarray) -> jnp.ndarray:
    """RoPE on split halves (the HF/Tunix convention); x [B, T, N, D], positions [B, T]."""
    angle = (positions[..., None] / timescale[None, None, :])[..., None, :]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)


_CURRENT: contextvars.ContextVar[Architecture | None] = contextvars.ContextVar("grpo_stream_rope", default=None)
_PATCHED: set[str] = set()


@contextlib.contextmanager
def rope_of(arch: Architecture):
    """While tracing a Tunix Llama 3 / Qwen3 module inside this block, its attention uses `arch`'s RoPE."""
    _patch_tunix(arch.family)
    token = _CURRENT.set(arch)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _patch_tunix(family: str) -> None:
    if family not in ("llama3", "qwen3") or family in _PATCHED:
        return  # Qwen2's Tunix code reads rope_theta itself
    if family == "llama3":
        from tunix.models.llama3 import model as module  # noqa: PLC0415
    else:
        from tunix.models.qwen3 import model as module  # noqa: PLC0415
    original = module.apply_rope

    def apply_rope_of_current_architecture(inputs, positions, head_dim, rope_theta=1_000_000):
        arch = _CURRENT.get()
        if arch is None or arch.family != family or arch.head_dim != head_dim:
            return original(inputs, positions, head_dim, rope_theta)  # called outside rope_of: Tunix's behaviour
        return apply_rope(inputs, positions, rope_timescale(arch))

    module.apply_rope = apply_rope_of_current_architecture
    _PATCHED.add(family)


def tunix_config(arch: Architecture, dtype: Any = jnp.float32):
    """The Tunix family's ModelConfig for `arch` (parameters and computation in `dtype`)."""
    common = dict(num_layers=arch.num_layers, vocab_size=arch.vocab_size, embed_dim=arch.embed_dim,
                  hidden_dim=arch.hidden_dim, num_heads=arch.num_heads, head_dim=arch.head_dim,
                  num_kv_heads=arch.num_kv_heads, rope_theta=arch.rope_theta, norm_eps=arch.norm_eps)
    if arch.family == "llama3":
        from tunix.models.llama3 import model as llama3  # noqa: PLC0415

        return llama3.ModelConfig(**common, weight_tying=arch.tied_embeddings)
    if arch.family == "qwen2":
        from tunix.models.qwen2 import model as qwen2  # noqa: PLC0415

        return qwen2.ModelConfig(**common, use_tied_embedding=arch.tied_embeddings, dtype=dtype, param_dtype=dtype)
    if arch.family == "gemma3":
        from tunix.models.gemma3 import model as gemma3  # noqa: PLC0415

        norm = gemma3.QueryPreAttentionNormalisation
        return gemma3.ModelConfig(
            num_layers=arch.num_layers, num_embed=arch.vocab_size, embed_dim=arch.embed_dim,
            hidden_dim=arch.hidden_dim, num_heads=arch.num_heads, head_dim=arch.head_dim,
            num_kv_heads=arch.num_kv_heads, sliding_window_size=arch.sliding_window,
            local_base_frequency=arch.rope_local_theta, global_base_frequency=arch.rope_theta,
            global_scale_factor=arch.rope_linear_factor, param_dtype=dtype,
            query_pre_attn_norm=(norm.BY_ONE_OVER_SQRT_HEAD_DIM if arch.query_pre_attn_scalar == arch.head_dim
                                 else norm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS))
    if arch.family == "gemma2":
        from tunix.models.gemma import model as gemma  # noqa: PLC0415

        kinds = {"sliding_attention": gemma.AttentionType.LOCAL_SLIDING, "full_attention": gemma.AttentionType.GLOBAL}
        return gemma.ModelConfig(
            num_layers=arch.num_layers, num_embed=arch.vocab_size, embed_dim=arch.embed_dim,
            hidden_dim=arch.hidden_dim, num_heads=arch.num_heads, head_dim=arch.head_dim,
            num_kv_heads=arch.num_kv_heads, final_logit_softcap=arch.final_softcap, use_post_attn_norm=True,
            use_post_ffw_norm=True, attention_types=tuple(kinds[t] for t in arch.layer_types),
            attn_logits_soft_cap=arch.attn_softcap, sliding_window_size=arch.sliding_window)
    from tunix.models.qwen3 import model as qwen3  # noqa: PLC0415

    return qwen3.ModelConfig(**common, use_tied_embedding=arch.tied_embeddings, dtype=dtype, param_dtype=dtype)


def module_class(arch: Architecture):
    if arch.family == "llama3":
        from tunix.models.llama3.model import Llama3  # noqa: PLC0415

        return Llama3
    if arch.family == "qwen2":
        from tunix.models.qwen2.model import Qwen2  # noqa: PLC0415

        return Qwen2
    if arch.family == "gemma2":
        from tunix.models.gemma.model import Gemma  # noqa: PLC0415

        return Gemma
    if arch.family == "gemma3":
        from tunix.models.gemma3.model import Gemma3  # noqa: PLC0415

        return Gemma3
    from tunix.models.qwen3.model import Qwen3  # noqa: PLC0415

    return Qwen3


def to_hf_config(arch: Architecture, dtype: str = "float32") -> dict:
    """A `config.json` for `arch` that `transformers` loads (used by export and by the tests' tiny models)."""
    model_type = {v: k for k, v in FAMILIES.items()}[arch.family]
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
    config = {
        "architectures": [names[model_type]], "model_type": model_type, "vocab_size": arch.vocab_size,
        "hidden_size": arch.embed_dim, "intermediate_size": arch.hidden_dim, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
        "rms_norm_eps": arch.norm_eps, "rope_theta": arch.rope_theta, "tie_word_embeddings": arch.tied_embeddings,
        "hidden_act": "silu", "max_position_embeddings": arch.max_position_embeddings, "torch_dtype": dtype,
        "attention_bias": arch.qkv_bias, "use_sliding_window": False,
    }
    if arch.family == "gemma2":
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=arch.head_dim,
                      attn_logit_softcapping=arch.attn_softcap, final_logit_softcapping=arch.final_softcap,
                      sliding_window=arch.sliding_window, layer_types=list(arch.layer_types))
        config.pop("hidden_act")
        config.pop("use_sliding_window")
    if arch.family == "gemma3":
        full = {"rope_type": "linear", "factor": arch.rope_linear_factor} if arch.rope_linear_factor != 1 else {
            "rope_type": "default"}
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=int(arch.query_pre_attn_scalar),
                      sliding_window=arch.sliding_window, layer_types=list(arch.layer_types),
                      rope_parameters={"full_attention": {**full, "rope_theta": arch.rope_theta},
                                       "sliding_attention": {"rope_type": "default",
                                                             "rope_theta": arch.rope_local_theta}})
        for key in ("hidden_act", "use_sliding_window", "attention_bias"):
            config.pop(key)
        # the same RoPE in the keys transformers 4 reads, so older loaders (and vLLM builds on them) agree
        config["rope_local_base_freq"] = arch.rope_local_theta
        if arch.rope_linear_factor != 1:
            config["rope_scaling"] = {"rope_type": "linear", "factor": arch.rope_linear_factor}
    if arch.rope_scaling:
        config["rope_scaling"] = {"rope_type": "llama3", **dict(arch.rope_scaling)}
        config["rope_scaling"]["original_max_position_embeddings"] = int(
            config["rope_scaling"]["original_max_position_embeddings"])
    return config

