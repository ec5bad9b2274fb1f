"""The optimizer, and the compiled supervised warm-start step (the RL update is in rl_update.py).

Parameters below float32 (model.dtype=bfloat16) are trained through a float32 master copy by default
(trainer.optimizer.state_dtype=float32): the optimizer's moments and the copy it updates are float32, and the
parameters the model computes with (and that are published) are that copy rounded to bfloat16 after each update.
Updating bfloat16 parameters directly would round away every update smaller than about 1/256 of a weight, which at
RL learning rates (1e-6 to 1e-5) is nearly all of them.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_stream.common.config.learning import OptimizerSection
from grpo_stream.common.model.policy import PolicyModel, sequence_logprobs


def learning_rate_schedule(learning_rate: float, opt: OptimizerSection | None, total_steps: int,
                           updates_per_step: int = 1) -> float | optax.Schedule:
    """trainer.learning_rate shaped by trainer.optimizer's schedule, as a function of the optimizer update count
    (a trainer step is `updates_per_step` updates); a plain float when constant, so the optimizer state keeps the
    layout it has without a schedule."""
    if opt is None or opt.schedule == "constant":
        return learning_rate
    warmup = opt.warmup_steps * updates_per_step
    if opt.schedule == "warmup_constant":
        return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup),
                                     optax.constant_schedule(learning_rate)], [warmup])
    decay = (opt.decay_steps or total_steps) * updates_per_step
    return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup, decay, learning_rate * opt.end_lr_factor)


def make_optimizer(learning_rate: float, max_grad_norm: float, opt: OptimizerSection | None = None,
                   total_steps: int = 1, updates_per_step: int = 1) -> optax.GradientTransformation:
    """Global-norm clip, then Adam (the warm start, and trainer.optimizer.name=adam) or AdamW with decoupled weight
    decay, at `learning_rate` shaped by `opt`'s schedule over `total_steps` trainer steps."""
    rate = learning_rate_schedule(learning_rate, opt, total_steps, updates_per_step)
    if opt is None:
        return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(rate))
    if opt.name == "adamw":
        inner = optax.adamw(rate, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay)
    else:
        inner = optax.adam(rate, b1=opt.b1, b2=opt.b2, eps=opt.eps)
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), inner)


class MasterWeights(NamedTuple):
    """Optimizer state with a float32 master copy: the copy, and the inner optimizer's state (float32 moments)."""

    params: Any
    inner: Any


def uses_master_weights(params: Any, state_dtype: str) -> bool:
    """True when `params` hold a dtype below float32 and trainer.optimizer.state_dtype asks for float32 state."""
    return state_dtype == "float32" and any(x.dtype != jnp.float32 for x in jax.tree.leaves(params))


def init_optimizer_state(optimizer: optax.GradientTransformation, params: Any, master: bool) -> Any:
    if not master:
        return optimizer.init(params)
    copy = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    return MasterWeights(copy, optimizer.init(copy))


def apply_optimizer(optimizer: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any,
                    master: bool) -> tuple[Any, Any]:
    """(new params, new optimizer state) after one update with `grads`; with a master copy the update happens in
    float32 and the parameters become the updated copy in their own dtype."""
    if not master:
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    updates, inner = optimizer.update(grads, opt_state.inner, opt_state.params)
    copy = optax.apply_updates(opt_state.params, updates)
    return jax.tree.map(lambda c, p: c.astype(p.dtype), copy, params), MasterWeights(copy, inner)


def make_sft_step(model: PolicyModel, optimizer: optax.GradientTransformation, pad_id: int, master: bool = False,
                  out_shardings: Any = None):
    """step(params, opt_state, tokens, valid, loss_mask) -> (params, opt_state, loss): token-mean cross-entropy;
    `master`: opt_state is init_optimizer_state(..., master=True)'s; `out_shardings`: (params, opt_state, loss)
    placements, which a mesh over several processes needs (left to XLA, the loss may land on one process's device
    only, where the others cannot read it)."""

    def loss_fn(params, tokens, valid, loss_mask):
        logprobs = sequence_logprobs(model, params, tokens, valid, 1.0, pad_id)
        return -(logprobs * loss_mask).sum() / jnp.maximum(loss_mask.sum(), 1.0)

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def step(params, opt_state, tokens, valid, loss_mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, valid, loss_mask)
        params, opt_state = apply_optimizer(optimizer, grads, opt_state, params, master)
        return params, opt_state, loss

    return step
