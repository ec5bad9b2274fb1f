"""Activation sharding for the trainer's programs: batch rows over `fsdp`, features over `tp`, as Tunix intends.

Tunix's models mark their activations with sharding constraints (`act_btd` = (fsdp, None, tp) for the hidden
states, `act_btf` for the MLP, `act_btnh` for the heads) through a module-level `shard()` that applies them only
inside the legacy `with mesh:` context, which JAX now deprecates and this project never entered, and never on CPU.
Without them XLA's sharding propagation is free to lay activations out as it likes, and for an FSDP step it chose
to replicate them: a Llama-3.2-1B update step with two sequences per device kept 8.1 GiB of temporaries per device
on one device, 22.1 GiB on fsdp=4 and 36.1 GiB on fsdp=8 (`grpo-stream plan`, CPU-compiled). With the constraints
applied, fsdp=8 came to 14.9 GiB.

`activation_sharding(mesh)` makes Tunix's `shard()` (of the modules the family records name in
`TunixPatches.shard_modules`: every family's own, and `tunix.utils.sharding_utils` that Gemma 3 uses) apply the
constraint on `mesh` while a program is traced inside it, on every platform, so the CPU tests and
`grpo-stream plan` compile the layout TPU and GPU runs get. Outside the block Tunix's own function runs unchanged.
A mesh axis that does not divide a dimension is dropped for it (as for the parameters).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from typing import Any, Iterator

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_stream.common.model.families import FAMILIES
from grpo_stream.common.model.sharding import fit_spec

# the Tunix modules whose `shard(x, spec)` each family's layers call at trace time (each record's
# TunixPatches.shard_modules): all are routed, whatever family a process runs, as the hook itself is family-blind
TUNIX_SHARD_MODULES = tuple(dict.fromkeys(m for f in FAMILIES for m in f.tunix_patches.shard_modules))
LOGITS_SPEC = ("fsdp", None, "tp")  # [B, T, V]: rows as the hidden states, the vocabulary as the embedding's rows

_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("grpo_stream_activation_mesh", default=None)
_PATCHED: set[str] = set()


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None) -> Iterator[None]:
    """While a program is traced inside this block, the model's activation constraints apply on `mesh` (nothing
    changes for None or a one-device mesh)."""
    if mesh is None or mesh.size == 1:
        yield
        return
    _patch_tunix()
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def constrain(x: Any, spec: tuple) -> Any:
    """`x` constrained to `spec` on the active mesh (axes that do not divide dropped); `x` itself outside a block."""
    mesh = _MESH.get()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, fit_spec(PartitionSpec(*spec), x.shape, mesh)))


def _patch_tunix() -> None:
    for name in TUNIX_SHARD_MODULES:
        if name in _PATCHED:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue  # a Tunix without this family
        original = module.shard

        def shard(x, s, *args, _original=original, **kwargs):
            if _MESH.get() is None:
                return _original(x, s, *args, **kwargs)  # traced outside activation_sharding: Tunix's behaviour
            return constrain(x, tuple(s))

        module.shard = shard
        _PATCHED.add(name)
