"""The sampler's forward pass: the policy's Qwen3 decoder written for KV-cached decoding.

Training uses Tunix's module (`PolicyModel.apply`); sampling spends its time in
one-token steps, where that module's layout costs more than its arithmetic:
per step it transposes the output projection, reshapes the cache for grouped
attention and runs many small dots. This is the same function of the same
parameters, laid out for decoding:

- Q, K, V projections fused into one [embed, (q+2kv)*head_dim] matmul, gate
  and up into one [embed, 2*hidden] matmul, the output projection flattened
  to [q*head_dim, embed]; done once per weight version (`DecodeWeights`), not
  per token.
- The cache is [batch, kv_heads, slots, head_dim] so grouped-query attention is
  two batched matmuls over slots with no transposes of the cache.

It reproduces Tunix 0.1.7's Qwen3 numerics (float32 RMSNorm, RoPE with base
1e6 on split halves, masked logits set to the same constant before a float32
softmax); `tests/unit/common/test_decode.py` checks logits and cache-decoded
logits against `PolicyModel.apply`, and the engine's behaviour logprobs
against the trainer's recomputation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from common.model import TUNIX_ROPE_THETA, PolicyModel

MASKED = -2.3819763e38  # Tunix's masked-logit value, so softmax rounding matches


@struct.dataclass
class LayerWeights:
    input_norm: jax.Array    # [E]
    qkv: jax.Array           # [E, (H + 2 KV) * D]
    q_norm: jax.Array        # [D]
    k_norm: jax.Array        # [D]
    out: jax.Array           # [H * D, E]
    post_norm: jax.Array     # [E]
    gate_up: jax.Array       # [E, 2 F]
    down: jax.Array          # [F, E]


@struct.dataclass
class DecodeWeights:
    embedding: jax.Array     # [V, E]
    layers: tuple            # of LayerWeights
    final_norm: jax.Array    # [E]
    lm_head: jax.Array       # [E, V]


def decode_weights(model: PolicyModel, params: Any) -> DecodeWeights:
    """Re-lay `params` (the trainer's Tunix pytree) for decoding. Traceable; run it inside jit."""
    named = dict(zip(model.names(), jax.tree_util.tree_leaves(params)))
    cfg = model.config
    layers = []
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        flat = [named[f"{p}attn.{n}_proj.w"].reshape(cfg.embed_dim, -1) for n in ("q", "k", "v")]
        layers.append(LayerWeights(
            input_norm=named[f"{p}input_layernorm.w"], qkv=jnp.concatenate(flat, axis=1),
            q_norm=named[f"{p}attn.q_norm.w"], k_norm=named[f"{p}attn.k_norm.w"],
            out=named[f"{p}attn.o_proj.w"].reshape(-1, cfg.embed_dim),
            post_norm=named[f"{p}post_attention_layernorm.w"],
            gate_up=jnp.concatenate([named[f"{p}mlp.gate_proj.kernel"], named[f"{p}mlp.up_proj.kernel"]], axis=1),
            down=named[f"{p}mlp.down_proj.kernel"]))
    return DecodeWeights(embedding=named["embedder.input_embedding"], layers=tuple(layers),
                         final_norm=named["final_norm.w"], lm_head=named["lm_head.w"])


def init_cache(model: PolicyModel, batch: int, slots: int) -> tuple:
    """Per layer (keys, values), each [batch, kv_heads, slots, head_dim], zeros."""
    cfg = model.config
    shape = (batch, cfg.num_kv_heads, slots, cfg.head_dim)
    return tuple((jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)) for _ in range(cfg.num_layers))


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * normed).astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """RoPE on split halves; x [B, T, N, D], positions [B, T]."""
    half = x.shape[-1] // 2
    timescale = TUNIX_ROPE_THETA ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
    angle = (positions[..., None] / timescale)[..., None, :]
    sin, cos = jnp.sin(angle).astype(x.dtype), jnp.cos(angle).astype(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def forward(model: PolicyModel, w: DecodeWeights, tokens: jax.Array, positions: jax.Array, cache: tuple,
            slot: jax.Array | int, key_valid: jax.Array) -> tuple[jax.Array, tuple]:
    """Logits [B, T, V] for `tokens` [B, T], writing their keys/values at cache slots slot..slot+T-1.

    `positions` [B, T] are RoPE positions; `key_valid` [B, T, S] says which cache
    slots each query may attend to (the caller's causal and padding mask).
    """
    cfg = model.config
    b, t = tokens.shape
    heads, kv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps
    group = heads // kv
    x = w.embedding[tokens].astype(cfg.dtype)
    new_cache = []
    for layer, (keys, values) in zip(w.layers, cache):
        h = _rms_norm(x, layer.input_norm, eps)
        qkv = (h @ layer.qkv).reshape(b, t, heads + 2 * kv, d)
        q = _rope(_rms_norm(qkv[:, :, :heads], layer.q_norm, eps), positions)
        k = _rope(_rms_norm(qkv[:, :, heads:heads + kv], layer.k_norm, eps), positions)
        v = qkv[:, :, heads + kv:]
        keys = jax.lax.dynamic_update_slice(keys, k.transpose(0, 2, 1, 3), (0, 0, slot, 0))
        values = jax.lax.dynamic_update_slice(values, v.transpose(0, 2, 1, 3), (0, 0, slot, 0))
        new_cache.append((keys, values))
        # queries of one KV head side by side: [B, KV, group * T, D]
        qg = q.reshape(b, t, kv, group, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, group * t, d)
        scores = jnp.einsum("bkqd,bksd->bkqs", qg, keys) * d ** -0.5
        scores = jnp.where(key_valid[:, None, None], scores.reshape(b, kv, group, t, -1), MASKED)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
        attn = jnp.einsum("bkqs,bksd->bkqd", probs.reshape(b, kv, group * t, -1), values)
        attn = attn.reshape(b, kv, group, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, heads * d)
        x = x + attn @ layer.out
        h = _rms_norm(x, layer.post_norm, eps)
        gate_up = h @ layer.gate_up
        hidden = gate_up.shape[-1] // 2
        x = x + (jax.nn.silu(gate_up[..., :hidden]) * gate_up[..., hidden:]) @ layer.down
    x = _rms_norm(x, w.final_norm, eps)
    return x @ w.lm_head, tuple(new_cache)


def sample_inverse_cdf(key: jax.Array, logp: jax.Array) -> jax.Array:
    """One draw per row from softmax(logp) [B, V] by inverse transform: one uniform per row.

    Exact for the categorical distribution up to float rounding of the running
    sum, and far cheaper on CPU than Gumbel-max (which needs V random numbers
    and two logs per row). Zero-probability tokens (the masked pad) are never
    drawn: u is in (0, 1], so the first index whose running sum reaches u * total
    always adds probability mass.
    """
    return inverse_cdf_index(1.0 - jax.random.uniform(key, (logp.shape[0],), jnp.float32), logp)


def inverse_cdf_index(u: jax.Array, logp: jax.Array) -> jax.Array:
    """The token whose CDF interval holds u [B] (each in (0, 1]) under softmax(logp) [B, V]."""
    u = u[:, None]
    cdf = jnp.cumsum(jnp.exp(logp), axis=-1)
    index = jnp.sum(cdf < u * cdf[:, -1:], axis=-1)
    return jnp.minimum(index, logp.shape[-1] - 1).astype(jnp.int32)
