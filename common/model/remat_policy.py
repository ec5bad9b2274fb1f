"""Checkpoint policies for Tunix's rematerialised decoder layers (trainer.remat=save_dots).

Tunix's decoder modules call nnx.remat without a policy (save nothing, recompute everything). While a model whose
remat mode has a policy is traced inside `remat_policy_of`, the Tunix module's `nnx` (of each family whose record asks
for the remat_policy patch, `TunixPatches.remat_policy`) is a proxy whose `remat` adds that policy; outside such a
block it is nnx.remat unchanged (the same approach as architectures.rope_of).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from typing import Any

import jax
from flax import nnx

from grpo_stream.common.model.families import family_named

# trainer.remat modes that save some of a rematerialised layer's values: 'save_dots' keeps the outputs of matrix
# products with the weights (no batch dimension: not attention's scores), so the backward pass recomputes only the
# cheap elementwise work between them (norms, activations, RoPE): most of 'full's saving at a fraction of its
# recompute (measured on an H200: BENCHMARKS.md, "plan")
REMAT_POLICIES = {"save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}
_POLICY: contextvars.ContextVar[Any] = contextvars.ContextVar("grpo_stream_remat_policy", default=None)


class _NnxWithRematPolicy:
    """flax.nnx as a Tunix model module sees it, except `remat`, which takes the current checkpoint policy."""

    def __getattr__(self, name: str) -> Any:
        return getattr(nnx, name)

    @staticmethod
    def remat(f: Any = None, **kwargs: Any) -> Any:
        policy = _POLICY.get()
        if policy is not None and kwargs.get("policy") is None:
            kwargs["policy"] = policy
        return nnx.remat(**kwargs) if f is None else nnx.remat(f, **kwargs)


@contextlib.contextmanager
def remat_policy_of(family: str, mode: str):
    """While tracing a Tunix `family` model built for trainer.remat `mode` inside this block, its nnx.remat saves
    what the mode's policy allows; modes without one ('none', 'attention', 'full') change nothing."""
    policy = REMAT_POLICIES.get(mode)
    if policy is None:
        yield
        return
    record = family_named(family)
    if not record.tunix_patches.remat_policy:
        raise ValueError(f"trainer.remat={mode}: the {family} family's record has no remat_policy patch "
                         "(TunixPatches.remat_policy), so its layers cannot take the checkpoint policy")
    module = importlib.import_module(record.tunix_module)
    if not isinstance(module.nnx, _NnxWithRematPolicy):
        module.nnx = _NnxWithRematPolicy()
    token = _POLICY.set(policy)
    try:
        yield
    finally:
        _POLICY.reset(token)
