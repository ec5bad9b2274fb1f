"""Model architectures: a Hugging Face `config.json` mapped to Tunix's model code, and RoPE done right.

`Architecture` is what grpo-stream needs to know of a decoder (read from a checkpoint's `config.json`, or built for
the tiny demo model); `tunix_config` turns it into the Tunix family's `ModelConfig` (nothing in Tunix 0.1.7 does
this). What each family needs (its config.json fields, Tunix module, parameter names, ...) is its record in
`grpo_stream.common.model.families`; the functions here dispatch to it. A config using a feature Tunix's model code
lacks is refused with the field named, never silently approximated.

RoPE: Tunix 0.1.7's Llama 3 and Qwen3 attention apply RoPE with base 1e6 whatever the config says, and nothing
implements Llama 3.1's frequency scaling. The `apply_rope` of each family whose record asks for the rope patch
(`TunixPatches.rope`) is replaced (once per process) by one that, while a model is traced inside `rope_of(arch)` (as
`PolicyModel.apply` does), uses that architecture's frequencies (`rope_timescale`, the numbers `transformers`
computes), so Llama 3.1 (base 500000, `llama3` scaling) and Qwen3 checkpoints with any base give the right logits.
Outside `rope_of` the original runs unchanged, so several models with different settings can share a process.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import math
from typing import Any

import jax.numpy as jnp

from grpo_stream.common.model.families import (Architecture, ArchitectureError, family_for_hf_config, family_named,
                                               family_of)


def from_hf_config(config: dict, where: str = "config.json") -> Architecture:
    """The architecture a Hugging Face `config.json` (parsed) describes; errors name the field."""
    family = family_for_hf_config(config, where)
    try:
        return family.parse_hf_config(config, where)
    except ArchitectureError:
        raise
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        # a backstop for a field of a type the parser does not check (a string where a number belongs, ...): an
        # untrusted config.json must not end in a traceback
        raise ArchitectureError(f"{where}: a {family.hf_model_type} field has an unusable value ({type(exc).__name__}:"
                                f" {exc}); compare config.json with the model's published one") from None


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
    """While tracing a Tunix module whose family has the rope patch inside this block, its attention uses `arch`'s
    RoPE (other families read their RoPE settings from their ModelConfig: nothing to do)."""
    _patch_tunix(arch.family)
    token = _CURRENT.set(arch)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _patch_tunix(family: str) -> None:
    record = family_named(family)
    if not record.tunix_patches.rope or family in _PATCHED:
        return
    module = importlib.import_module(record.tunix_module)
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
    return family_of(arch).tunix_config(arch, dtype)


def module_class(arch: Architecture):
    """The Tunix nnx.Module class of `arch`'s family."""
    record = family_of(arch)
    return getattr(importlib.import_module(record.tunix_module), record.tunix_class)


def to_hf_config(arch: Architecture, dtype: str = "float32") -> dict:
    """A `config.json` for `arch` that `transformers` loads (used by export and by the tests' tiny models): the
    shapes every family shares, then the family's own fields."""
    record = family_of(arch)
    config = {
        "architectures": [record.hf_architecture], "model_type": record.hf_model_type, "vocab_size": arch.vocab_size,
        "hidden_size": arch.embed_dim, "intermediate_size": arch.hidden_dim, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
        "rms_norm_eps": arch.norm_eps, "rope_theta": arch.rope_theta, "tie_word_embeddings": arch.tied_embeddings,
        "max_position_embeddings": arch.max_position_embeddings, "torch_dtype": dtype,
    }
    config.update(record.hf_config_fields(arch))
    return config


__all__ = ["Architecture", "ArchitectureError", "apply_rope", "from_hf_config", "gemma3_timescales",
           "module_class", "rope_of", "rope_timescale", "tunix_config", "to_hf_config"]
