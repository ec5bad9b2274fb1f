"""The packed update's compiled programs (trainer.packing; the layout is packing.py's).

A minibatch is a variable number of packed passes of one shape, so the passes run from a Python loop over three
programs compiled once for the run: `accumulate` adds one pass's gradients and statistics to an accumulator
(donated, so it is updated in place), `apply` makes the minibatch's one optimizer update from the sum, and
`logprobs` gives a pass's per-sequence logprobs under fixed weights (the old policy, the KL reference). A
lax.scan over the passes would compile again for every pass count a batch's lengths lead to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from grpo_stream.common.model.activation_sharding import activation_sharding
from grpo_stream.common.model.policy import row_logprobs, segment_mask
from grpo_stream.common.model.sharding import rows_sharding
from grpo_stream.trainer_service.packing import PackedMicroBatch, PackedMinibatch, PackingLayout
from grpo_stream.trainer_service.train_step import apply_optimizer

if TYPE_CHECKING:
    from grpo_stream.trainer_service.rl_update import PolicyUpdater


def metric_start(shapes: dict) -> dict:
    """The accumulator's start for metrics shaped like `shapes`: -inf for `_max`, +inf for `_min`, else 0."""
    return {key: jnp.full(v.shape, -jnp.inf if key.endswith("_max") else jnp.inf if key.endswith("_min") else 0.0,
                          v.dtype) for key, v in shapes.items()}


def merge_metrics(total: dict, part: dict) -> dict:
    """Combine one pass's metrics into the running ones: `_max` by max, `_min` by min, the rest (each pass's share
    of a minibatch mean) by sum."""
    return {key: jnp.maximum(total[key], v) if key.endswith("_max") else
            jnp.minimum(total[key], v) if key.endswith("_min") else total[key] + v for key, v in part.items()}


class PackedPrograms:
    """The compiled programs of `updater`'s packed update and the minibatch loop that drives them."""

    def __init__(self, updater: "PolicyUpdater", layout: PackingLayout, donate: bool):
        self.u, self.layout = updater, layout
        mesh = updater.mesh
        self._rows = rows_sharding(mesh, layout.rows) if mesh is not None else None
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None else None
        grads = updater._param_shardings
        self._start = jax.jit(self._start_impl, static_argnums=1,
                              out_shardings=(grads, replicated) if mesh is not None else None)
        self._accumulate = jax.jit(self._accumulate_impl, donate_argnums=(2,),
                                   out_shardings=(grads, replicated) if mesh is not None else None)
        self._apply = jax.jit(self._apply_impl, donate_argnums=(0, 1) if donate else (),
                              out_shardings=updater._apply_shardings)
        self._logprobs = jax.jit(self._logprobs_impl)
        self._metric_keys: tuple | None = None

    def sequence_logprobs(self, params, mb: PackedMicroBatch, with_entropy: bool = False):
        """Per-sequence logprobs (and entropies) of a pass: [m * S, C], slot-major, the completion window of each
        slot's sequence in the padded layout."""
        u, c = self.u, self.layout.completion_tokens
        out = row_logprobs(u.model, params, mb.tokens, mb.positions, segment_mask(mb.segments), u.temperature,
                           u.pad_id, with_entropy)
        gather = lambda x: jnp.take_along_axis(x, mb.index, axis=1).reshape(-1, c)  # noqa: E731
        return tuple(gather(x) for x in out) if with_entropy else gather(out)

    def _loss(self, train, frozen, mb: PackedMicroBatch, old, ref, norm):
        u, c = self.u, self.layout.completion_tokens
        logprobs, entropy = self.sequence_logprobs(u.join(train, frozen), mb, with_entropy=True)
        flat = lambda x: None if x is None else x.reshape(-1, c)  # noqa: E731
        return u.objective(logprobs, entropy, flat(mb.loss_mask), flat(mb.behaviour), mb.advantages.reshape(-1),
                           mb.fresh.reshape(-1), flat(old), flat(ref), norm)

    def _start_impl(self, train, keys: tuple):
        zeros = self.u.pin(jax.tree.map(jnp.zeros_like, train))
        return zeros, metric_start({key: jax.ShapeDtypeStruct((), jnp.float32) for key in keys})

    def _accumulate_impl(self, train, frozen, acc, mb: PackedMicroBatch, old, ref, norm):
        with activation_sharding(self.u.mesh):  # traced with the model's activation constraints on the mesh
            (_, metrics), grads = jax.value_and_grad(self._loss, has_aux=True)(train, frozen, mb, old, ref, norm)
        total, merged = acc
        return jax.tree.map(jnp.add, total, self.u.pin(grads)), merge_metrics(merged, metrics)

    def _apply_impl(self, train, opt_state, grads):
        u = self.u
        train, opt_state = apply_optimizer(u.optimizer, grads, opt_state, train, u.master)
        return train, opt_state, optax.global_norm(grads)

    def _logprobs_impl(self, params, mb: PackedMicroBatch):
        with activation_sharding(self.u.mesh):
            return self.sequence_logprobs(params, mb)

    def place(self, packed: PackedMinibatch) -> list[PackedMicroBatch]:
        """The minibatch's passes on the devices, rows split over the fsdp axis."""
        if self._rows is None:
            return [jax.tree.map(jnp.asarray, mb) for mb in packed.micro_batches]
        return [jax.device_put(mb, self._rows) for mb in packed.micro_batches]

    def logprobs(self, params, passes: list[PackedMicroBatch]) -> list[jax.Array]:
        return [self._logprobs(params, mb) for mb in passes]

    def keys(self, train, frozen, mb, old, ref, norm) -> tuple:
        """The metric names the loss reports for these inputs (traced once, abstractly)."""
        if self._metric_keys is None:
            shapes = jax.eval_shape(lambda *a: self._loss(*a)[1], train, frozen, mb, old, ref, norm)
            self._metric_keys = tuple(sorted(shapes))
        return self._metric_keys

    def gradients(self, train, frozen, passes, old, ref, norm) -> tuple[Any, dict]:
        """(gradients of the trained part, metrics) of a minibatch: its passes' sums (the padded layout's
        PolicyUpdater.gradients, for the packed one)."""
        norm = tuple(jnp.float32(x) for x in norm)
        pick = lambda xs, j: None if xs is None else xs[j]  # noqa: E731
        acc = self._start(train, self.keys(train, frozen, passes[0], pick(old, 0), pick(ref, 0), norm))
        for j, mb in enumerate(passes):
            acc = self._accumulate(train, frozen, acc, mb, pick(old, j), pick(ref, j), norm)
        return acc

    def minibatch_step(self, train, frozen, opt_state, passes, old, ref, norm) -> tuple[Any, Any, dict]:
        """One optimizer update from the summed gradients of a minibatch's passes: (train, opt_state, metrics)."""
        grads, metrics = self.gradients(train, frozen, passes, old, ref, norm)
        train, opt_state, grad_norm = self._apply(train, opt_state, grads)
        return train, opt_state, {**metrics, "grad_norm": grad_norm}
