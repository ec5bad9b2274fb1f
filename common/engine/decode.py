"""The sampler's forward pass: the policy's decoder (Llama 3, Qwen2/3, Gemma 2/3) laid out for KV-cached decoding.

Training uses Tunix's module (`PolicyModel.apply`); sampling spends its time in
one-token steps, where that module's layout costs more than its arithmetic:
per step it transposes the output projection, reshapes the cache for grouped
attention and runs many small dots. This is the same function of the same
parameters, laid out for decoding:

- Q, K, V projections fused into one [embed, (q+2kv)*head_dim] matmul, gate
  and up into one [embed, 2*hidden] matmul, the output projection flattened
  to [q*head_dim, embed]; done once per weight version (`DecodeWeights`), not
  per token.
- The cache holds keys as [batch, kv_heads, head_dim, slots] and values as
  [batch, kv_heads, slots, head_dim], so both products of grouped-query
  attention (q.k over head_dim, p.v over slots) are plain row-major matrix
  products over the cache with no transposes of it: on XLA:CPU the keys'
  [.., slots, head_dim] layout made the score product several times slower.

Which layout and options a model takes is its family record's `DecodeSpec`
(`grpo_stream.common.model.families`). It reproduces the numerics of Tunix's modules with grpo-stream's RoPE
(`grpo_stream.common.model.architectures.rope_of`): float32 RMSNorm, RoPE on split halves,
Qwen2's QKV biases, Qwen3's q/k norms before RoPE, tied heads, masked logits
set to the same constant before a float32 softmax (in bfloat16, Tunix's
Gemma code normalises and takes the softmax in bfloat16 where this uses
float32, so there the two differ by more than rounding). Tests check logits
and cache-decoded logits against `PolicyModel.apply` (test_decode.py) and
against `transformers` for every family, and the engine's behaviour logprobs
against the trainer's recomputation (test_hf_checkpoint.py).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from grpo_stream.common.engine import cpu_attention
from grpo_stream.common.model.activation_sharding import constrain
from grpo_stream.common.model.architectures import apply_rope, gemma3_timescales, rope_timescale
from grpo_stream.common.model.families import family_of
from grpo_stream.common.model.policy import PolicyModel

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


@struct.dataclass
class GemmaLayerWeights:
    pre_attn_norm: jax.Array   # [E], as 1 + w (Gemma's norms scale by 1 + w)
    qkv: jax.Array             # [E, (H + 2 KV) * D]
    out: jax.Array             # [H * D, E]
    post_attn_norm: jax.Array  # [E], 1 + w
    pre_ffw_norm: jax.Array    # [E], 1 + w
    gate_up: jax.Array         # [E, 2 F]
    down: jax.Array            # [F, E]
    post_ffw_norm: jax.Array   # [E], 1 + w
    q_norm: jax.Array | None   # [D], 1 + w (Gemma 3)
    k_norm: jax.Array | None   # [D], 1 + w (Gemma 3)
    rope_timescale: jax.Array  # [D / 2]: Gemma 3's sliding and full layers differ


def _gemma_weights(model: PolicyModel, named: dict) -> DecodeWeights:
    arch = model.arch
    e = arch.embed_dim
    spec = family_of(arch).decode
    local, full = gemma3_timescales(arch) if spec.per_layer_rope else (rope_timescale(arch),) * 2
    layers = []
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        post_attn = named[f"{p}{spec.post_attn_norm}.scale"]
        if f"{p}attn.qkv_einsum.w" in named:
            q, k, v = named[f"{p}attn.qkv_einsum.w"]
        else:
            q, (k, v) = named[f"{p}attn.q_einsum.w"], named[f"{p}attn.kv_einsum.w"]
        flat = [t.transpose(1, 0, 2).reshape(e, -1) for t in (q, k, v)]  # [N, E, H] -> [E, N * H]
        layers.append(GemmaLayerWeights(
            pre_attn_norm=1 + named[f"{p}pre_attention_norm.scale"], qkv=jnp.concatenate(flat, axis=1),
            out=named[f"{p}attn.attn_vec_einsum.w"].reshape(-1, e), post_attn_norm=1 + post_attn,
            pre_ffw_norm=1 + named[f"{p}pre_ffw_norm.scale"],
            gate_up=jnp.concatenate([named[f"{p}mlp.gate_proj.kernel"], named[f"{p}mlp.up_proj.kernel"]], axis=1),
            down=named[f"{p}mlp.down_proj.kernel"], post_ffw_norm=1 + named[f"{p}post_ffw_norm.scale"],
            q_norm=1 + named[f"{p}attn._query_norm.scale"] if spec.qk_norm else None,
            k_norm=1 + named[f"{p}attn._key_norm.scale"] if spec.qk_norm else None,
            rope_timescale=full if arch.layer_types[i] == "full_attention" else local))
    embedding = named["embedder.input_embedding"]
    return DecodeWeights(embedding=embedding, layers=tuple(layers), final_norm=1 + named["final_norm.scale"],
                         lm_head=embedding.T, rope_timescale=rope_timescale(arch))


def decode_weights(model: PolicyModel, params: Any) -> DecodeWeights:
    """Re-lay `params` (the trainer's Tunix pytree) for decoding. Traceable; run it inside jit."""
    named = dict(zip(model.names(), jax.tree_util.tree_leaves(params)))
    arch = model.arch
    if family_of(arch).decode.layout == "gemma":
        return _gemma_weights(model, named)
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


KEY_SLOT_AXIS, VALUE_SLOT_AXIS = 3, 2  # the cache-position axis of keys [B, KV, D, S] and values [B, KV, S, D]
# Inside activation_sharding(mesh) (the engine's programs on a sampler's tp mesh): the caches' KV heads and the
# attention's heads q, k, v [B, T, heads, D] over `tp`, whole where `tp` does not divide them. The new keys and values
# are laid out as their cache before they are written: left to propagation, XLA split a cache of 2 KV heads over
# tp=4 in the decode loop and all-reduced all of it every step.
CACHE_SPEC, HEADS_SPEC = (None, "tp", None, None), (None, None, "tp", None)


def pin_cache(cache: tuple) -> tuple:
    """Per layer (keys, values) constrained to CACHE_SPEC on the active mesh (unchanged outside one)."""
    return tuple((constrain(k, CACHE_SPEC), constrain(v, CACHE_SPEC)) for k, v in cache)


def init_cache(model: PolicyModel, batch: int, slots: int, dtype: Any = None) -> tuple:
    """Per layer (keys [batch, kv_heads, head_dim, slots], values [batch, kv_heads, slots, head_dim]), zeros (in
    the parameters' dtype)."""
    arch = model.arch
    dtype = dtype or jax.tree_util.tree_leaves(model.params)[0].dtype
    b, kv, d = batch, arch.num_kv_heads, arch.head_dim
    return tuple((jnp.zeros((b, kv, d, slots), dtype), jnp.zeros((b, kv, slots, d), dtype))
                 for _ in range(arch.num_layers))


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * normed).astype(x.dtype)


def forward(model: PolicyModel, w: DecodeWeights, tokens: jax.Array, positions: jax.Array, cache: tuple,
            slot: jax.Array | int, key_valid: jax.Array, last: jax.Array | None = None) -> tuple[jax.Array, tuple]:
    """Logits [B, T, V] (float32) for `tokens` [B, T], writing their keys/values at cache slots slot..slot+T-1;
    with `last` [B], the logits [B, V] of each row's position last[b] only (a prefill's next token).

    `positions` [B, T] are RoPE positions; `key_valid` [B, T, S] says which of the
    first S cache slots each query may attend to (the caller's causal and padding
    mask; S may be shorter than the cache). `slot`: a scalar, or per row [B] when T = 1.
    """
    logits, (cache,) = forward_groups(model, w, tokens, positions, (cache,), (slot,), (key_valid,), last=last)
    return logits, cache


def _at(x: jax.Array, last: jax.Array | None) -> jax.Array:
    """The final hidden states [B, T, E], or at each row's position `last` [B] only ([B, E]): a prefill needs one
    position's logits a row, and the vocabulary-wide float32 logits of every prompt position were most of a sampler's
    peak memory (`plan`: about 10 of Qwen2.5-1.5B's 11.8 GB)."""
    return x if last is None else x[jnp.arange(x.shape[0]), last]


def forward_groups(model: PolicyModel, w: DecodeWeights, tokens: jax.Array, positions: jax.Array, caches: tuple,
                   slots: tuple, key_valids: tuple, ragged: bool = False,
                   last: jax.Array | None = None) -> tuple[jax.Array, tuple]:
    """`forward` over rows that come in groups, each with its own cache (and so its own attention window): the rows
    of `tokens` are the groups' rows one group after another (group g has key_valids[g].shape[0] rows), the weight
    matmuls run once over all of them and attention per group. Returns the logits and the groups' caches.

    `ragged` (one token per row, per-row `slots`, key_valids[g] = positions up to the row's slot, float32 on one
    CPU device): attention reads each row's own positions through the CPU kernel (cpu_attention.py) instead of the
    group's whole window."""
    if family_of(model.arch).decode.layout == "gemma":
        return _forward_gemma(model, w, tokens, positions, caches, slots, key_valids, ragged, last)
    arch = model.arch
    b, t = tokens.shape
    heads, kv, d, eps = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.norm_eps
    x = w.embedding[tokens]
    new_caches = [[] for _ in caches]
    for i, layer in enumerate(w.layers):
        h = _rms_norm(x, layer.input_norm, eps)
        qkv = h @ layer.qkv
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        qkv = qkv.reshape(b, t, heads + 2 * kv, d)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + kv], qkv[:, :, heads + kv:]
        if layer.q_norm is not None:
            q, k = _rms_norm(q, layer.q_norm, eps), _rms_norm(k, layer.k_norm, eps)
        q, k = apply_rope(q, positions, w.rope_timescale), apply_rope(k, positions, w.rope_timescale)
        attn = _attend_groups(q, k, v, caches, i, slots, key_valids, new_caches, kv, None, None, ragged)
        x = x + attn @ layer.out
        h = _rms_norm(x, layer.post_norm, eps)
        gate_up = h @ layer.gate_up
        hidden = gate_up.shape[-1] // 2
        x = x + (jax.nn.silu(gate_up[..., :hidden]) * gate_up[..., hidden:]) @ layer.down
    x = _rms_norm(_at(x, last), w.final_norm, eps)
    return (x @ w.lm_head).astype(jnp.float32), tuple(tuple(c) for c in new_caches)


def _attend_groups(q, k, v, caches, layer: int, slots, key_valids, new_caches, kv, softcap, scale, ragged=False):
    """Attention of each group's rows over its own cache of `layer`; appends the written caches to new_caches."""
    outs, start = [], 0
    for g, (cache, slot, valid) in enumerate(zip(caches, slots, key_valids)):
        n = valid.shape[0]
        rows = slice(start, start + n) if len(caches) > 1 else slice(None)
        attn, keys, values = _attention(q[rows], k[rows], v[rows], *cache[layer], slot, valid, kv, softcap, scale,
                                        ragged)
        outs.append(attn)
        new_caches[g].append((keys, values))
        start += n
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs)


def _attention(q, k, v, keys, values, slot, key_valid, kv: int, softcap: float | None, scale: float | None = None,
               ragged: bool = False):
    """Write k, v at `slot` of the cache and attend: q [B, T, H, D] -> [B, T, H * D] (q scaled by `scale`,
    default 1/sqrt(D)).

    `slot`: one cache slot for every row (an int or scalar), or one per row ([B] array, T = 1: the continuous
    engine's slots each sit at their own length). Attention reads only the first key_valid.shape[-1] slots, so a
    caller that knows no row is longer attends over that window, not the whole cache. `ragged` (per-row slots,
    key_valid = positions 0..slot): each row reads only its own positions, through the CPU kernel.
    """
    b, t, heads, d = q.shape
    group = heads // kv
    q, k, v = constrain(q, HEADS_SPEC), constrain(k, HEADS_SPEC), constrain(v, HEADS_SPEC)
    if jnp.ndim(slot) == 1:
        rows = jnp.arange(b)
        keys = keys.at[rows, :, :, slot].set(k[:, 0].astype(keys.dtype), mode="drop")
        values = values.at[rows, :, slot].set(v[:, 0].astype(values.dtype), mode="drop")
    else:
        keys = jax.lax.dynamic_update_slice(keys, k.transpose(0, 2, 3, 1).astype(keys.dtype), (0, 0, 0, slot))
        values = jax.lax.dynamic_update_slice(values, v.transpose(0, 2, 1, 3).astype(values.dtype), (0, 0, slot, 0))
    keys, values = constrain(keys, CACHE_SPEC), constrain(values, CACHE_SPEC)
    scaled = q * (d ** -0.5 if scale is None else scale)
    if ragged:
        assert t == 1 and jnp.ndim(slot) == 1, "ragged attention serves one token per row at per-row slots"
        out = cpu_attention.ragged_attention(scaled.reshape(b, kv, group, d), keys, values, slot + 1, softcap)
        return out.astype(q.dtype).reshape(b, t, heads * d), keys, values
    window = key_valid.shape[-1]
    # a window shorter than the cache is a slice, which XLA copies: callers in a hot loop size the cache to it
    seen_keys = keys if window == keys.shape[3] else keys[..., :window]
    seen_values = values if window == values.shape[2] else values[:, :, :window]
    # queries of one KV head side by side: [B, KV, group * T, D]
    qg = scaled.reshape(b, t, kv, group, d).transpose(0, 2, 3, 1, 4).reshape(b, kv, group * t, d)
    scores = jnp.einsum("bkqd,bkds->bkqs", qg, seen_keys)
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(key_valid[:, None, None], scores.reshape(b, kv, group, t, -1), MASKED)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    attn = jnp.einsum("bkqs,bksd->bkqd", probs.reshape(b, kv, group * t, -1), seen_values)
    return attn.reshape(b, kv, group, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, heads * d), keys, values


def _forward_gemma(model: PolicyModel, w: DecodeWeights, tokens, positions, caches, slots, key_valids, ragged=False,
                   last=None):
    """Gemma 2 and 3: scaled embedding, (1 + w) norms around attention and MLP, tanh-GELU; Gemma 2 soft-caps
    logits, Gemma 3 normalises q and k and uses per-layer RoPE bases.

    Sliding-window layers attend like global ones here: the runtime refuses
    sequences longer than the window (`check_sequence_fits`), where the two agree.
    """
    arch = model.arch
    b, t = tokens.shape
    heads, kv, d, eps = arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.norm_eps
    x = w.embedding[tokens]
    x = x * jnp.sqrt(jnp.float32(arch.embed_dim)).astype(x.dtype)
    scale = (arch.query_pre_attn_scalar or d) ** -0.5
    new_caches = [[] for _ in caches]
    for i, layer in enumerate(w.layers):
        h = _rms_norm(x, layer.pre_attn_norm, eps)
        qkv = (h @ layer.qkv).reshape(b, t, heads + 2 * kv, d)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads:heads + kv], qkv[:, :, heads + kv:]
        if layer.q_norm is not None:
            q, k = _rms_norm(q, layer.q_norm, eps), _rms_norm(k, layer.k_norm, eps)
        q, k = apply_rope(q, positions, layer.rope_timescale), apply_rope(k, positions, layer.rope_timescale)
        attn = _attend_groups(q, k, v, caches, i, slots, key_valids, new_caches, kv, arch.attn_softcap, scale,
                              ragged)
        x = x + _rms_norm(attn @ layer.out, layer.post_attn_norm, eps)
        h = _rms_norm(x, layer.pre_ffw_norm, eps)
        gate_up = h @ layer.gate_up
        hidden = gate_up.shape[-1] // 2
        mlp = (jax.nn.gelu(gate_up[..., :hidden], approximate=True) * gate_up[..., hidden:]) @ layer.down
        x = x + _rms_norm(mlp, layer.post_ffw_norm, eps)
    logits = (_rms_norm(_at(x, last), w.final_norm, eps) @ w.lm_head).astype(jnp.float32)
    if arch.final_softcap is not None:
        logits = jnp.tanh(logits / arch.final_softcap) * arch.final_softcap
    return logits, tuple(tuple(c) for c in new_caches)


def check_sequence_fits(model: PolicyModel, total_tokens: int,
                        field: str = "generation.max_prompt_tokens + generation.max_new_tokens") -> None:
    """Gemma's sliding-window layers are exact here only for sequences within the window, and no model's positions
    past its max_position_embeddings (its RoPE was never trained there: vLLM refuses such a max_model_len too);
    `field`: the setting that asks for `total_tokens`, named in the error."""
    longest = model.arch.max_position_embeddings
    if longest and total_tokens > longest:
        raise ValueError(f"{field} = {total_tokens} exceeds the model's max_position_embeddings={longest} (its "
                         "config.json): positions past it are ones its RoPE was never trained on; shorten it")
    window = model.arch.sliding_window
    if family_of(model.arch).decode.layout == "gemma" and window is not None and total_tokens > window:
        raise ValueError(f"{field} = {total_tokens} exceeds the model's sliding_window={window}; shorten it "
                         "(sliding windows are not implemented)")


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
