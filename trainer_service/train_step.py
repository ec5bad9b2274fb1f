"""The optimizer, and the compiled supervised warm-start step (the RL update is in rl_update.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from grpo_stream.common.model.policy import PolicyModel, sequence_logprobs


def make_optimizer(learning_rate: float, max_grad_norm: float) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(learning_rate))


def make_sft_step(model: PolicyModel, optimizer: optax.GradientTransformation, pad_id: int):
    """step(params, opt_state, tokens, valid, loss_mask) -> (params, opt_state, loss): token-mean cross-entropy."""

    def loss_fn(params, tokens, valid, loss_mask):
        logprobs = sequence_logprobs(model, params, tokens, valid, 1.0, pad_id)
        return -(logprobs * loss_mask).sum() / jnp.maximum(loss_mask.sum(), 1.0)

    @jax.jit
    def step(params, opt_state, tokens, valid, loss_mask):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, valid, loss_mask)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
