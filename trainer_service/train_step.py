"""Compiled optimizer steps: the RL step (clipped GRPO) and the supervised warm-start step."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from common.model import PolicyModel, sequence_logprobs
from trainer_service.batching import TrainBatch
from trainer_service.loss import grpo_policy_loss


def make_optimizer(learning_rate: float, max_grad_norm: float) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(learning_rate))


def make_rl_step(model: PolicyModel, optimizer: optax.GradientTransformation, temperature: float, pad_id: int,
                 eps_low: float, eps_high: float) -> Callable[[Any, Any, TrainBatch, jnp.ndarray], tuple]:
    """step(params, opt_state, batch, fresh) -> (params, opt_state, metrics).

    `fresh` [B] marks sequences generated with exactly the weights being
    updated (staleness 0): on those the behaviour and recomputed logprobs
    must agree, which the metrics `logprob_diff_*` report.
    """

    def loss_fn(params, batch: TrainBatch, fresh):
        logprobs = sequence_logprobs(model, params, batch.tokens, batch.valid, temperature, pad_id)
        loss, metrics = grpo_policy_loss(logprobs, batch.behaviour_logprobs, batch.advantages, batch.loss_mask,
                                         eps_low, eps_high)
        diff = jnp.abs(jax.lax.stop_gradient(logprobs) - batch.behaviour_logprobs)
        fresh_mask = batch.loss_mask * fresh[:, None]
        metrics["logprob_diff_mean"] = (diff * fresh_mask).sum() / jnp.maximum(fresh_mask.sum(), 1.0)
        metrics["logprob_diff_max"] = jnp.max(diff * fresh_mask)
        metrics["fresh_tokens"] = fresh_mask.sum()
        # entropy proxy: mean negative logprob of the sampled tokens under the current policy
        metrics["token_nll"] = -(jax.lax.stop_gradient(logprobs) * batch.loss_mask).sum() / jnp.maximum(
            batch.loss_mask.sum(), 1.0)
        return loss, metrics

    @jax.jit
    def step(params, opt_state, batch: TrainBatch, fresh):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, fresh)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics["loss"] = loss
        metrics["grad_norm"] = optax.global_norm(grads)
        return params, opt_state, metrics

    return step


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
