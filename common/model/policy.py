"""The policy model: Tunix model code, split into a static graph and a params pytree.

Both services build the model the same way and exchange parameters as a flat
mapping `name -> numpy array` (names like `layers.0.attn.q_proj.w`), which
is what travels on the wire and what a checkpoint holds. The policy's
distribution is defined once here (`token_logprobs`): the sampler's
behaviour logprobs and the trainer's recomputed logprobs use the same
function, so they agree to float rounding.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from grpo_stream.common.model import architectures, hf_checkpoint
from grpo_stream.common.model.activation_sharding import LOGITS_SPEC, constrain
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.families import FAMILIES, RematSupport, Unsupported, family_of
from grpo_stream.common.model.remat_policy import remat_policy_of
from grpo_stream.common.model.sharding import host_copy, param_shardings
from grpo_stream.common.config.learning import ModelSection

NEG_INF = -1e30


@dataclasses.dataclass
class PolicyModel:
    """Graph definition plus parameter pytree of a Tunix decoder."""

    graphdef: Any
    params: Any  # nnx.State of arrays (or ShapeDtypeStructs when abstract)
    config: Any  # tunix ModelConfig
    arch: Architecture  # family and shapes, as a Hugging Face config.json states them
    remat_mode: str = "none"  # trainer.remat this graph was built for (with_remat)

    def names(self) -> list[str]:
        return [_path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(self.params)]

    def to_named_numpy(self, params: Any | None = None) -> dict[str, np.ndarray]:
        """Host copy of `params` (default: own params) as name -> array, in a stable order."""
        tree = self.params if params is None else params
        leaves = jax.tree_util.tree_leaves(tree)
        if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
            leaves = jax.device_get(leaves)  # one batched transfer
        else:  # a multi-process trainer: every process takes part in gathering each leaf
            leaves = [host_copy(leaf) for leaf in leaves]
        return {name: np.asarray(leaf) for name, leaf in zip(self.names(), leaves)}

    def named_arrays(self, params: Any | None = None) -> dict[str, Any]:
        """name -> array (device arrays stay on device) of `params` (default: own params)."""
        tree = self.params if params is None else params
        return dict(zip(self.names(), jax.tree_util.tree_leaves(tree)))

    def params_from_arrays(self, named: dict[str, Any]) -> Any:
        """Params pytree from name -> device array, as placed (checks names, shapes and dtypes; no copies)."""
        leaves, treedef = jax.tree_util.tree_flatten(self.params)
        for name, leaf in zip(self.names(), leaves):
            arr = named.get(name)
            if arr is None or tuple(arr.shape) != tuple(leaf.shape) or arr.dtype != leaf.dtype:
                got = "nothing" if arr is None else f"{arr.dtype}{list(arr.shape)}"
                raise ValueError(f"parameter {name}: got {got}, model wants {leaf.dtype}{list(leaf.shape)}")
        return jax.tree_util.tree_unflatten(treedef, [named[n] for n in self.names()])

    def from_named_numpy(self, named: dict[str, np.ndarray]) -> Any:
        """Params pytree with this model's structure from name -> array; checks names, shapes, dtypes."""
        leaves, treedef = jax.tree_util.tree_flatten(self.params)
        names = self.names()
        missing = [n for n in names if n not in named]
        extra = [n for n in named if n not in set(names)]
        if missing or extra:
            raise ValueError(f"parameter names differ from the model: missing {missing[:3]}, unexpected {extra[:3]}")
        out = []
        for name, leaf in zip(names, leaves):
            arr = named[name]
            if tuple(arr.shape) != tuple(leaf.shape) or arr.dtype != leaf.dtype:
                raise ValueError(f"parameter {name}: got {arr.dtype}{list(arr.shape)}, model wants "
                                 f"{leaf.dtype}{list(leaf.shape)}")
            out.append(jnp.asarray(arr))
        return jax.tree_util.tree_unflatten(treedef, out)

    def apply(self, params: Any, tokens, positions, cache, attention_mask):
        model = nnx.merge(self.graphdef, params)
        with architectures.rope_of(self.arch), remat_policy_of(self.arch.family, self.remat_mode):
            return model(tokens, positions, cache, attention_mask)

    def with_remat(self, mode: str) -> "PolicyModel":
        """The same model and parameters, with activations rematerialised in the backward pass (trainer.remat:
        'attention' or 'full' decoder layers, or 'save_dots': full layers except their matrix products' outputs;
        'none' returns self). Only the trainer's update uses it: sampling and evaluation take no gradients."""
        if mode == "none":
            return self
        cfg = remat_config(self.arch, self.config, mode)
        cls = architectures.module_class(self.arch)
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0))))
        return dataclasses.replace(self, graphdef=graphdef, config=cfg, remat_mode=mode)

    def num_params(self) -> int:
        return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(self.params)))


def _path_name(path) -> str:
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            if key.name != "value":
                parts.append(key.name)
        else:
            parts.append(str(key))
    return ".".join(parts)


# Tunix 0.1.7's Qwen3 attention applies RoPE with its default base 1e6 whatever
# the config says, so the config states that base rather than pretend to choose.
TUNIX_ROPE_THETA = 1_000_000


def tiny_architecture(section: ModelSection, vocab_size: int) -> Architecture:
    """The tiny demo model: a Qwen3-architecture decoder with untied embeddings."""
    t = section.tiny
    return Architecture(family="qwen3", vocab_size=vocab_size, num_layers=t.num_layers, embed_dim=t.embed_dim,
                        hidden_dim=t.hidden_dim, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
                        head_dim=t.head_dim, norm_eps=1e-6, rope_theta=TUNIX_ROPE_THETA, tied_embeddings=False)


def tunix_config(section: ModelSection, vocab_size: int):
    return architectures.tunix_config(tiny_architecture(section, vocab_size))


def build_model(section: ModelSection, vocab_size: int, seed: int | None, dtype: str | None = None) -> PolicyModel:
    """Random-init model from `seed`, or an abstract one (shapes only) when seed is None, in `dtype` (default
    model.dtype).

    Samplers build the abstract model and receive every weight from the trainer.
    """
    dtype = jnp.bfloat16 if (dtype or section.dtype) == "bfloat16" else jnp.float32
    return build_from_architecture(tiny_architecture(section, vocab_size), seed, dtype)


def build_from_architecture(arch: Architecture, seed: int | None, dtype: Any = jnp.float32) -> PolicyModel:
    """A model of `arch`: random init from `seed`, or abstract (shapes and dtypes only) when seed is None."""
    cfg = architectures.tunix_config(arch, dtype)
    cls = architectures.module_class(arch)
    if seed is None:
        module = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    else:
        module = cls(cfg, rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(module)
    # Tunix's Llama has no dtype setting: its parameters take the dtype they are given
    params = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype) if isinstance(x, jax.ShapeDtypeStruct) else x.astype(dtype),
        params)
    return PolicyModel(graphdef=graphdef, params=params, config=cfg, arch=arch)


def load_hf_model(directory: str, dtype: str = "float32", mesh: jax.sharding.Mesh | None = None) -> PolicyModel:
    """A Hugging Face checkpoint directory (config.json + safetensors) as a PolicyModel in `dtype`.

    With a `mesh` (axes named `fsdp` and `tp`, as Tunix annotates its parameters;
    Auto axis types), each parameter goes straight onto its sharding on the mesh
    (sharding.param_shardings: an axis that does not divide a dimension is
    replicated), each device taking only its slices, so the model never has to
    fit on one device; else on the default device. Host memory holds the
    checkpoint once while loading (tensors are memory-mapped and only copied
    where the dtype or layout changes).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"model.dtype={dtype!r}: choose float32 or bfloat16")
    jdtype = jnp.float32 if dtype == "float32" else jnp.bfloat16
    arch = hf_checkpoint.read_architecture(directory)
    hf_checkpoint.check_stored_tensors(directory, arch)  # before building shapes, which takes as long as the layers
    abstract = build_from_architecture(arch, seed=None, dtype=jdtype)
    names = abstract.names()
    leaves, treedef = jax.tree_util.tree_flatten(abstract.params)
    named = hf_checkpoint.read_named(directory, arch, {n: tuple(leaf.shape) for n, leaf in zip(names, leaves)},
                                     np.dtype(jdtype))
    shardings = (jax.tree_util.tree_leaves(param_shardings(abstract.params, mesh)) if mesh is not None
                 else [None] * len(names))
    placed = [jax.device_put(named.pop(n), s) for n, s in zip(names, shardings)]
    return dataclasses.replace(abstract, params=jax.tree_util.tree_unflatten(treedef, placed))


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float, pad_id: int) -> jax.Array:
    """log pi(target) under the policy: softmax(logits / T) with the pad token excluded.

    Pad is never a valid output, so it is removed from the distribution; the
    sampler and the trainer both use this function, which is what makes
    behaviour and recomputed logprobs agree.
    """
    logp = policy_log_softmax(logits, temperature, pad_id)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def policy_log_softmax(logits: jax.Array, temperature: float, pad_id: int) -> jax.Array:
    scaled = logits.astype(jnp.float32) / temperature
    scaled = scaled.at[..., pad_id].set(NEG_INF)
    return jax.nn.log_softmax(scaled, axis=-1)


def positions_from_mask(valid: jax.Array) -> jax.Array:
    """Absolute positions of tokens under left padding: 0 at the first valid token."""
    return jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)


def causal_mask(valid: jax.Array) -> jax.Array:
    """[B, L, L] attention mask: causal, and only valid (non-pad) keys."""
    length = valid.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    return causal[None] & valid[:, None, :].astype(jnp.bool_)


def segment_mask(segments: jax.Array) -> jax.Array:
    """[B, L, L] attention mask of packed rows: causal within each segment (ids > 0; 0 is padding). A token of one
    segment sees none of another's, so a packed sequence's logits are those it has alone in a padded row."""
    length = segments.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    same = segments[:, :, None] == segments[:, None, :]
    return causal[None] & same & (segments[:, None, :] > 0)


def sequence_logprobs(model: PolicyModel, params: Any, tokens: jax.Array, valid: jax.Array,
                      temperature: float, pad_id: int, with_entropy: bool = False):
    """logprob of tokens[:, 1:] given their prefixes: [B, L-1]. Full forward, no cache.

    With `with_entropy`, also the policy's entropy at each of those positions ([B, L-1]).
    """
    return row_logprobs(model, params, tokens, positions_from_mask(valid), causal_mask(valid), temperature, pad_id,
                        with_entropy)


def row_logprobs(model: PolicyModel, params: Any, tokens: jax.Array, positions: jax.Array, mask: jax.Array,
                 temperature: float, pad_id: int, with_entropy: bool = False):
    """sequence_logprobs for rows with explicit `positions` and attention `mask` ([B, L, L]): a padded row's
    (positions_from_mask, causal_mask) or a packed row's (positions restarting per segment, segment_mask)."""
    logits, _ = model.apply(params, tokens, positions, None, mask)
    logits = constrain(logits, LOGITS_SPEC)  # inside activation_sharding: rows over fsdp, vocabulary over tp
    logp = policy_log_softmax(logits[:, :-1], temperature, pad_id)
    chosen = jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    if not with_entropy:
        return chosen
    probs = jnp.exp(logp)
    entropy = -jnp.sum(jnp.where(probs > 0, probs * logp, 0.0), axis=-1)
    return chosen, entropy


def remat_config(arch: Architecture, config: Any, mode: str) -> Any:
    """`config` (a Tunix ModelConfig of `arch`) with rematerialisation `mode` ('none', 'attention', 'full' or
    'save_dots', whose checkpoint policy PolicyModel.apply supplies), as the family's record (`remat`) allows."""
    if mode == "none":
        return config
    remat = family_of(arch).remat
    if isinstance(remat, Unsupported) or mode not in remat.members:
        with_switch = [f.family for f in FAMILIES if isinstance(f.remat, RematSupport)]
        why = remat.reason if isinstance(remat, Unsupported) else f"the family's Tunix code has no {mode} member"
        raise ValueError(f"trainer.remat={mode}: the {arch.family} model has no rematerialisation switch ({why}; "
                         f"families with one: {', '.join(with_switch)}); use trainer.remat=none or micro-batches "
                         "(trainer.micro_batch_size) to save activation memory")
    member = getattr(importlib.import_module(family_of(arch).tunix_module).RematConfig, remat.members[mode])
    return dataclasses.replace(config, **{remat.field: member})
