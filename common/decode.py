"""The sampler's forward pass: the policy's decoder (Llama 3, Qwen2, Qwen3) written for KV-cached decoding.

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

It reproduces the numerics of Tunix's modules with grpo-stream's RoPE
(`common.architectures.rope_of`): float32 RMSNorm, RoPE on split halves,
Qwen2's QKV biases, Qwen3's q/k norms before RoPE, tied heads, masked logits
set to the same constant before a float32 softmax; `tests/unit/common/test_decode.py` checks logits and cache-decoded
logits against `PolicyModel.apply`, and the engine's behaviour logprobs
against the trainer's recomputation.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from common.architectures import apply_rope, rope_timescale
from common.model import PolicyModel

MASKED = -2.3819763e38  # Tunix's masked-logit value, so softmax rounding matches


@struct.dataclass
class LayerWeights:
    input_norm: jax.Array    # [E]
    qkv: jax.Array           # [E, (H + 2 KV) * D]
    qkv_bias: jax.Array | None  # [(H + 2 KV) * D] (Qwen2) or None
    q_norm: jax.Array | None    # [D] (Qwen3) or None
    k_norm: jax.Array | None    # [D] (Qwen3) or None
    out: jax.Array           # [H * D, E]
    post_norm: jax.Array     # [E]
    gate_up: jax.Array       # [E, 2 F]
    down: jax.Array          # [F, E]


@struct.dataclass
class DecodeWeights:
    embedding: jax.Array     # [V, E]
    layers: tuple            # of LayerWeights
    final_norm: jax.Array    # [E]
    lm_head: jax.Array       # [E, V] (the embedding transposed when tied)
    rope_timescale: jax.Array  # [D / 2] RoPE: angle = position / timescale


def decode_weights(model: PolicyModel, params: Any) -> DecodeWeights:
    """Re-lay `params` (the trainer's Tunix pytree) for decoding. Traceable; run it inside jit."""
    named = dict(zip(model.names(), jax.tree_util.tree_leaves(params)))
    arch = model.arch
    layers = []
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        flat = [named[f"{p}attn.{n}_proj.w"].reshape(arch.embed_dim, -1) for n in ("q", "k", "v")]
        bias = (jnp.concatenate([named[f"{p}attn.{n}_bias"] for n in ("q", "k", "v")]) if arch.qkv_bias else None)
        layers.append(LayerWeights(
            input_norm=named[f"{p}input_layernorm.w"], qkv=jnp.concatenate(flat, axis=1), qkv_bias=bias,
            q_norm=named[f"{p}attn.q_norm.w"] if arch.qk_norm else None,
            k_norm=named[f"{p}attn.k_norm.w"] if arch.qk_norm else None,
            out=named[f"{p}attn.o_proj.w"].reshape(-1, arch.embed_dim),
            post_norm=named[f"{p}post_attention_layernorm.w"],
            gate_up=jnp.concatenate([named[f"{p}mlp.gate_proj.kernel"], named[f"{p}mlp.up_proj.kernel"]], axis=1),
            down=named[f"{p}mlp.down_proj.kernel"]))
    embedding = named["embedder.input_embedding"]
    return DecodeWeights(embedding=embedding, layers=tuple(layers), final_norm=named["final_norm.w"],
                         lm_head=embedding.T if arch.tied_embeddings else named["lm_head.w"],
                         rope_timescale=rope_timescale(arch))


def init_cache(model: PolicyModel, batch: int, slots: int, dtype: Any = None) -> tuple:
    """Per layer (keys, values), each [batch, kv_heads, slots, head_dim], zeros (in the parameters' dtype)."""
    arch = model.arch
    dtype = dtype or jax.tree_util.tree_leaves(model.params)[0].dtype
    shape = (batch, arch.num_kv_heads, slots, arch.head_dim)
    return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(arch.num_layers))


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * normed).astype(x.dtype)


def forward(model: PolicyModel, w: DecodeWeights, tokens: jax.Array, positions: jax.Array, cache: tuple,
            slot: jax.Array | int, key_valid: jax.Array) -> tuple[jax.Array, tuple]:
    """Logits [B, T, V] (float32) for `tokens` [B, T], writing their keys/values at cache slots slot..slot+T-1.

    `positions` [B, T] are RoPE positions; `key_valid` [B, T, S] says which cache
    slots each query may attend to (the caller's causal and padding mask).
    """
    arch = model.arch
    b, t = tokens.shape
    heads, kv, d, eps = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.norm_eps
    group = heads // kv
    x = w.embedding[tokens]
    new_cache = []
    for layer, (keys, values) in zip(w.layers, cache):
        h = _rms_norm(x, layer.input_norm, eps)
        qkv = h @ layer.qkv
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qkv = qkv.reshape(b, t, heads + 2 * kv, d)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + kv], qkv[:, :, heads + kv:]
        if layer.q_norm is not None:
            q, k = _rms_norm(q, layer.q_norm, eps), _rms_norm(k, layer.k_norm, eps)
        q, k = apply_rope(q, positions, w.rope_timescale), apply_rope(k, positions, w.rope_timescale)
        keys = jax.lax.dynamic_update_slice(keys, k.transpose(0, 2, 1, 3).astype(keys.dtype), (0, 0, slot, 0))
        values = jax.lax.dynamic_update_slice(values, v.transpose(0, 2, 1, 3).astype(values.dtype), (0, 0, slot, 0))
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
    return (x @ w.lm_head).astype(jnp.float32), tuple(new_cache)


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
