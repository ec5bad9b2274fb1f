"""The update's compiled programs, over packed rows (the layout is packing.py's; trainer.packing=false is its case of
one sequence a row).

A minibatch is a variable number of packed passes of one shape. They are stacked to the most a minibatch can need
(PackingLayout.passes) and run by a `fori_loop` over the number in use, so one program does a whole minibatch
(its passes' gradients summed, then its one optimizer update) and compiles once for the run, whatever the lengths;
the stacked inputs are token ids and per-token floats, small beside one pass's activations. One program rather
than a Python loop of per-pass programs: on CPU the loop's passes ran ~12% slower (each run allocates its
activations anew); on accelerators it leaves XLA the whole minibatch to schedule.

A step's batch arrives packed on the host (packing.pack_batch) and is placed on the mesh in one transfer (`place`):
every process passes the same host arrays and keeps the shards of its own devices, and nothing of the batch comes
back to the host but the metrics.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from grpo_stream.common.model.activation_sharding import activation_sharding
from grpo_stream.common.model.policy import row_logprobs, segment_mask
from grpo_stream.trainer_service.learning.packing import PackedBatch, PackedPasses, PackingLayout
from grpo_stream.trainer_service.learning.train_step import apply_optimizer

if TYPE_CHECKING:
    from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater

LOG_RATIO = "proximal_log_ratio"  # the metrics key of the per-token o - b (PolicyUpdater.objective), not a statistic
DISTILL_KL = "distill_kl_tokens"  # the per-token o - t of distillation (its quantiles are the host's), not a statistic
# metrics keys holding per-token values: stacked per pass in row layout, never summed
PER_TOKEN = (LOG_RATIO, DISTILL_KL)


def metric_start(shapes: dict) -> dict:
    """The accumulator's start for metrics shaped like `shapes`: -inf for `_max`, +inf for `_min`, else 0."""
    return {key: jnp.full(v.shape, -jnp.inf if key.endswith("_max") else jnp.inf if key.endswith("_min") else 0.0,
                          v.dtype) for key, v in shapes.items()}


def merge_metrics(total: dict, part: dict) -> dict:
    """Combine one pass's metrics into the running ones: `_max` by max, `_min` by min, the rest (each pass's share
    of a minibatch mean) by sum."""
    return {key: jnp.maximum(total[key], v) if key.endswith("_max") else
            jnp.minimum(total[key], v) if key.endswith("_min") else total[key] + v for key, v in part.items()}


def slot_view(rows: jax.Array, starts: jax.Array, lengths: jax.Array, width: int) -> jax.Array:
    """[m * S, width]: for each of the S slots of each of the m rows, the `width` values of `rows` ([m, T - 1])
    from the slot's start on, zero past its length: per-sequence completion windows, as batching.py lays them out."""
    m, s = starts.shape
    j = jnp.arange(width)
    index = jnp.clip(starts[..., None] + j, 0, rows.shape[1] - 1).reshape(m, s * width)
    window = jnp.take_along_axis(rows, index, axis=1).reshape(m * s, width)
    return jnp.where((j < lengths[..., None]).reshape(m * s, width), window, 0.0)


def rows_of_slots(windows: jax.Array, starts: jax.Array, lengths: jax.Array, row_width: int) -> jax.Array:
    """[m, row_width]: slot_view's inverse, per-slot windows ([m * S, C]) back at their rows' positions, zero where
    no slot's completion is. The per-token outputs leave a pass in this layout: the slot windows hold S x C values a
    row (64 x 8,192 for a 512 + 8,192-token budget, ~60x the row's T - 1), nearly all of them empty slots' zeros."""
    m, s = starts.shape
    c = windows.shape[-1]
    j = jnp.arange(c)
    index = jnp.clip(starts[..., None] + j, 0, row_width - 1).reshape(m, s * c)
    # slots' windows never overlap in a row (each lies inside its own segment); the positions past a slot's length
    # (clipped, possibly repeated) add exact zeros, so the scatter-add is deterministic
    values = jnp.where(j < lengths[..., None], windows.reshape(m, s, c), 0.0).reshape(m, s * c)
    return jnp.zeros((m, row_width), windows.dtype).at[jnp.arange(m)[:, None], index].add(values)


class PackedPrograms:
    """The compiled programs of `updater`'s update: a minibatch's update, its gradients alone (tests, `plan`), and
    the logprobs of its passes under fixed weights (the old policy, the KL reference)."""

    def __init__(self, updater: "PolicyUpdater", layout: PackingLayout, donate: bool):
        self.u, self.layout = updater, layout
        mesh = updater.mesh
        fsdp = mesh.shape["fsdp"] if mesh is not None else 1
        self.sharding = (NamedSharding(mesh, PartitionSpec(None, "fsdp") if fsdp > 1 and layout.rows % fsdp == 0
                                       else PartitionSpec()) if mesh is not None else None)
        self.replicated = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
        self._step = jax.jit(self._step_impl, donate_argnums=(0, 2) if donate else (),
                             out_shardings=updater.state_shardings)
        self.gradients = jax.jit(self._gradients)
        self._logprobs = jax.jit(functools.partial(self._logprobs_impl, updater.model), out_shardings=self.sharding)
        teacher = updater.teacher
        # the teacher's forward: its own model and params, the policy's temperature, pad and rows
        self._teacher_logprobs = (jax.jit(functools.partial(self._logprobs_impl, teacher.model),
                                          out_shardings=self.sharding) if teacher is not None else None)

    def _loss(self, train, frozen, mb: PackedPasses, old, ref, teacher, norm):
        """(loss, metrics) of one pass ([m, ...] slices of PackedPasses; old, ref and teacher in row layout or
        None)."""
        u, c = self.u, self.layout.completion_tokens
        logprobs, entropy = row_logprobs(u.model, u.join(train, frozen), mb.tokens, mb.positions,
                                         segment_mask(mb.segments), u.temperature, u.pad_id, with_entropy=True)
        view = lambda x: None if x is None else slot_view(x, mb.starts, mb.lengths, c)  # noqa: E731
        return u.objective(view(logprobs), view(entropy), view(mb.loss_mask), view(mb.behaviour),
                           mb.advantages.reshape(-1), mb.fresh.reshape(-1), view(old), view(ref), norm,
                           teacher=view(teacher))

    def _accumulated(self, train, frozen, passes: PackedPasses, count, old, ref, teacher, norm):
        """(gradients of the trained part, metrics) of a minibatch: sums over its first `count` passes; the
        PER_TOKEN metrics stacked per pass in row layout ([K, m, T - 1], as the passes' loss_mask; rows_of_slots)."""
        u = self.u
        pick = lambda tree, i: jax.tree.map(lambda x: x[i], tree)  # noqa: E731
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        shapes = jax.eval_shape(lambda: grad_fn(train, frozen, *pick((passes, old, ref, teacher), 0), norm)[0][1])
        token_keys = [key for key in PER_TOKEN if shapes.pop(key, None) is not None]

        def body(i, carry):
            grads, metrics, tokens = carry
            # the weights pass a barrier with each pass's data, so FSDP gathers them layer by layer inside the pass:
            # XLA would otherwise hoist every layer's all-gather out of the loop as loop-invariant and keep the whole
            # model gathered for the whole step (the 70B preset's plan: ~270 GiB per chip more)
            weights, fixed, part = jax.lax.optimization_barrier((train, frozen, pick((passes, old, ref, teacher), i)))
            (_, m), g = grad_fn(weights, fixed, *part, norm)
            tokens = {key: v.at[i].set(rows_of_slots(m.pop(key), part[0].starts, part[0].lengths, v.shape[-1]))
                      for key, v in tokens.items()}
            return jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, u.pin(g)), merge_metrics(metrics, m), tokens

        # with a float32 master copy (bfloat16 weights) the passes' gradients are summed in float32, the dtype the
        # update reads them in: summed in bfloat16, each pass after the first rounded the sum to 8 bits of mantissa
        summed_in = jnp.float32 if u.master else None  # None: each parameter's own dtype
        with activation_sharding(u.mesh):  # traced with the model's activation constraints on the mesh
            zeros = u.pin(jax.tree.map(lambda x: jnp.zeros(x.shape, summed_in or x.dtype), train))
            start = {key: jnp.zeros(passes.loss_mask.shape, jnp.float32) for key in token_keys}
            grads, metrics, tokens = jax.lax.fori_loop(0, count, body, (zeros, metric_start(shapes), start))
            return grads, {**metrics, **tokens}

    def _gradients(self, train, frozen, passes: PackedPasses, count, old, ref, teacher, norm):
        """_accumulated's gradients and statistics (tests, `plan`)."""
        grads, metrics = self._accumulated(train, frozen, passes, count, old, ref, teacher, norm)
        for key in PER_TOKEN:
            metrics.pop(key, None)
        return grads, metrics

    def _step_impl(self, train, frozen, opt_state, passes: PackedPasses, count, old, ref, teacher, norm):
        grads, metrics = self._accumulated(train, frozen, passes, count, old, ref, teacher, norm)
        # a minibatch with no token in the loss (every completion filtered as overlong, say) takes no step: its
        # gradient is zero, but Adam's momentum, weight decay and the schedule's count would still move the weights
        train, opt_state = jax.lax.cond(
            norm[0] > 0, lambda: apply_optimizer(self.u.optimizer, grads, opt_state, train, self.u.master),
            lambda: (train, opt_state))
        for key in PER_TOKEN:
            if key in metrics:
                metrics[key] = self.u.replicated(metrics[key])
        return train, opt_state, {**metrics, "grad_norm": optax.global_norm(grads)}

    def _logprobs_impl(self, model, params, passes: PackedPasses, count):
        """[K, m, T - 1] row logprobs of the first `count` passes under `model` with `params` (zeros in the
        rest): the policy's own model (the old policy, the KL reference) or the distillation teacher's."""
        u = self.u

        def body(i, out):
            weights, part = jax.lax.optimization_barrier((params, jax.tree.map(lambda x: x[i], passes)))
            lp = row_logprobs(model, weights, part.tokens, part.positions, segment_mask(part.segments),
                              u.temperature, u.pad_id)
            return out.at[i].set(lp)

        with activation_sharding(u.mesh):
            return jax.lax.fori_loop(0, count, body, jnp.zeros(passes.loss_mask.shape, jnp.float32))

    def place(self, packed: PackedBatch) -> list[tuple[PackedPasses, jax.Array, tuple[jax.Array, jax.Array]]]:
        """Every minibatch of `packed` on the devices, in one transfer: (stacked passes, rows split over the fsdp
        axis; passes in use; loss normalisers), the scalars replicated. In a trainer of several processes each
        passes the same host arrays and places the shards of its own devices."""
        host = [(p.passes, np.int32(p.count), tuple(np.float32(x) for x in p.normalizers))
                for p in packed.minibatches]
        if self.sharding is None:
            return jax.device_put(host)
        where = (self.sharding, self.replicated, (self.replicated, self.replicated))
        return jax.device_put(host, [where] * len(host))

    def logprobs(self, params, passes: PackedPasses, count: jax.Array) -> jax.Array:
        return self._logprobs(params, passes, count)

    def teacher_logprobs(self, passes: PackedPasses, count: jax.Array) -> jax.Array:
        """[K, m, T - 1] the distillation teacher's row logprobs of the first `count` passes."""
        return self._teacher_logprobs(self.u.teacher.model.params, passes, count)

    def minibatch_step(self, train, frozen, opt_state, passes, count, norm, old, ref,
                       teacher=None) -> tuple[Any, Any, dict]:
        """One optimizer update from the summed gradients of a minibatch's passes (as `place` gives them):
        (train, opt_state, metrics)."""
        return self._step(train, frozen, opt_state, passes, count, old, ref, teacher, norm)
