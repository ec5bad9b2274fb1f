"""The policy objective: clipped GRPO / GSPO with truncated importance sampling and a KL penalty.

Notation for completion token t of sequence i (m_it = 1 on completion tokens):
  l_it  log-prob of the token under the policy being trained (gradient flows here)
  o_it  log-prob under the "old" (proximal) policy: the trainer's weights at the start of
        the step, recomputed by the trainer; with one iteration and one minibatch it is
        stop_gradient(l_it), so the ratio is exactly 1
  b_it  behaviour log-prob: what the sampler computed when it generated the token, with a
        policy version up to `trainer.max_staleness` steps older
  g_it  reference-model log-prob (only when beta > 0)
  A_i   the sequence's advantage (trainer_service/learning/advantages.py)

Ratio (log-space values clipped to [-20, 20] before exp, for float safety):
  grpo:        rho_it = exp(l_it - o_it)
  gspo-token:  rho_it = exp(l_it - sg(l_it) + sg(s_i)),  s_i = sum_t m_it (l_it - b_it) / sum_t m_it
               (the sequence-level ratio of GSPO against the policy that drew the sequence, its log capped at
               10, with per-token gradients; rl_update passes b as the ratio's base and no weight w)

Per-token loss:
  L_it = max(-A_i rho_it, -A_i clip(rho_it, 1 - eps_low, 1 + eps_high)) * w_it
  w_it = min(exp(o_it - b_it), tis_cap)   (truncated importance weight, stop-gradient; 1 when off)

Aggregation agg(X) over the masked tokens:
  token-mean                   sum_it m X / sum_it m
  sequence-mean-token-mean     mean over non-empty sequences of (sum_t m X / sum_t m)
  sequence-mean-token-sum-norm sum_it m X / (number of non-empty sequences)      (Dr.GRPO)

Total: loss = agg(L) + beta * agg(KL), with KL_it by `kl_estimator` and d = g_it - l_it:
  k1 = -d,  k2 = d^2 / 2,  k3 = exp(d) - d - 1.

On-policy distillation (distill section) replaces A_i by a per-token advantage, with t_it the teacher's log-prob
of the sampled token:
  A_it = reward_weight * A_i - kl_coef * (o_it - t_it)      (both log-probs detached)
o_it - t_it is the single-sample estimate of KL(student || teacher) at token t; `distill_advantages`.

For grpo the clip bounds the update relative to the proximal policy o; the weight w corrects for
the gap between the proximal policy and the sampler's policy b (staleness, and any
numerical mismatch), truncated so one stale token cannot dominate ("decoupled PPO").
Metrics: `ppo_kl` is the mean of (base - l) over the loss tokens, the base being the ratio's (o for grpo, b for
gspo-token: there it includes the sampler's staleness); `entropy` is the token mean whatever the aggregation, so
runs of different aggregations compare.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm")
LOG_RATIO_LIMIT = 20.0
GSPO_LOG_RATIO_MAX = 10.0


def normalizers(mask: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(masked tokens, non-empty sequences) of a [B, T] mask: the denominators of the aggregations. Gradient
    accumulation computes them over the whole minibatch and passes them to every micro-batch's loss, so the
    micro-batch losses add up to the minibatch's."""
    mask = mask.astype(jnp.float32)
    return mask.sum(), (mask.sum(axis=-1) > 0).sum().astype(jnp.float32)


def aggregate(per_token: jnp.ndarray, mask: jnp.ndarray, mode: str,
              norm: tuple[jnp.ndarray, jnp.ndarray] | None = None) -> jnp.ndarray:
    """Reduce [B, T] per-token values to a scalar over the masked tokens (see module docstring). `norm`: the
    (tokens, sequences) denominators of a larger batch this one is part of (default: this batch's own)."""
    per_token = per_token.astype(jnp.float32)
    mask = mask.astype(jnp.float32)
    tokens_per_seq = mask.sum(axis=-1)
    total_tokens, nonempty = normalizers(mask) if norm is None else norm
    nonempty = jnp.maximum(nonempty, 1.0)
    if mode == "token-mean":
        return (per_token * mask).sum() / jnp.maximum(total_tokens, 1.0)
    if mode == "sequence-mean-token-mean":
        return ((per_token * mask).sum(axis=-1) / jnp.maximum(tokens_per_seq, 1.0)).sum() / nonempty
    if mode == "sequence-mean-token-sum-norm":
        return (per_token * mask).sum() / nonempty
    raise ValueError(f"algo.loss_agg_mode={mode!r}: expected one of {AGG_MODES}")


def kl_per_token(logprobs: jnp.ndarray, ref_logprobs: jnp.ndarray, estimator: str) -> jnp.ndarray:
    """Per-token estimate of KL(policy || reference) from sampled tokens: k1, k2 or k3 (Schulman)."""
    d = ref_logprobs.astype(jnp.float32) - logprobs.astype(jnp.float32)
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * jnp.square(d)
    if estimator == "k3":
        # past LOG_RATIO_LIMIT eᵈ goes on as its tangent: a token the policy holds ~89 nats below the reference
        # overflowed float32 to inf (the update then NaN), while the KL pull on it stays, finite
        over = jnp.maximum(d - LOG_RATIO_LIMIT, 0.0)
        return jnp.exp(jnp.minimum(d, LOG_RATIO_LIMIT)) * (1.0 + over) - d - 1.0
    raise ValueError(f"algo.kl_estimator={estimator!r}: expected k1, k2 or k3")


def truncated_is_weights(old_logprobs: jnp.ndarray, behaviour_logprobs: jnp.ndarray, cap: float) -> jnp.ndarray:
    """w = min(exp(old - behaviour), cap), detached: corrects for sampling with an older policy."""
    log_w = jnp.clip(old_logprobs - behaviour_logprobs, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_w), cap))


def distill_advantages(advantages: jnp.ndarray, proximal: jnp.ndarray, teacher: jnp.ndarray, kl_coef: float,
                       reward_weight: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """([B, T] per-token advantages, [B, T] per-token reverse-KL estimates k) of on-policy distillation:
    k_it = o_it - t_it, the sampled-token estimate of KL(student || teacher) (the student's proximal log-prob o, the
    teacher's t); A_it = reward_weight * A_i - kl_coef * k_it. Both log-probs are detached: the teacher is a fixed
    reward, and the student's gradient comes through the policy-gradient term only (docs/objective.md)."""
    k = jax.lax.stop_gradient(proximal.astype(jnp.float32) - teacher.astype(jnp.float32))
    return reward_weight * advantages.astype(jnp.float32)[:, None] - kl_coef * k, k


def _masked_mean(x, mask, tokens=None):
    mask = mask.astype(jnp.float32)
    return (x * mask).sum() / ((mask.sum() if tokens is None else tokens) + 1e-8)


def policy_loss(logprobs: jnp.ndarray, old_logprobs: jnp.ndarray | None, advantages: jnp.ndarray,
                mask: jnp.ndarray, *, loss_algo: str, eps_low: float, eps_high: float, agg_mode: str,
                is_weights: jnp.ndarray | None = None, ref_logprobs: jnp.ndarray | None = None, beta: float = 0.0,
                kl_estimator: str = "k3", entropy: jnp.ndarray | None = None,
                norm: tuple[jnp.ndarray, jnp.ndarray] | None = None) -> tuple[jnp.ndarray, dict]:
    """The objective of the module docstring.

    Args:
      logprobs: [B, T] l, current policy (differentiated).
      old_logprobs: [B, T] o, proximal policy; None means stop_gradient(logprobs).
      advantages: [B] A (one a sequence), or [B, T] per-token advantages (distill_advantages).
      mask: [B, T] 1.0 on completion tokens that count.
      loss_algo: 'grpo' or 'gspo-token'.
      eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high].
      agg_mode: one of AGG_MODES.
      is_weights: [B, T] w (already truncated and detached) or None.
      ref_logprobs: [B, T] g; required when beta > 0.
      beta, kl_estimator: KL penalty weight and estimator.
      entropy: [B, T] per-token policy entropy, only reported.
      norm: (tokens, sequences) of the minibatch this is a micro-batch of (see `normalizers`): the loss and the
        mean metrics are then this micro-batch's share, and summing them over the micro-batches gives the
        minibatch's (the _max/_min metrics combine by max/min).

    Returns:
      (loss, metrics): pg_loss, clip_fraction (share of tokens where the clipped term is
      taken) and its parts clip_fraction_low / clip_fraction_high, ratio_mean/min/max,
      ppo_kl (mean o - l), kl and kl_loss (when ref_logprobs is given), entropy, is_weight_mean/min.
    """
    logprobs = logprobs.astype(jnp.float32)
    old = jax.lax.stop_gradient(logprobs) if old_logprobs is None else old_logprobs.astype(jnp.float32)
    mask = mask.astype(jnp.float32)
    log_ratio = logprobs - old
    tokens = None if norm is None else norm[0]
    ppo_kl = _masked_mean(-log_ratio, mask, tokens)
    log_ratio = jnp.clip(log_ratio, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if loss_algo == "gspo-token":
        seq_log_ratio = (log_ratio * mask).sum(axis=-1) / jnp.maximum(mask.sum(axis=-1), 1.0)
        log_ratio = logprobs - jax.lax.stop_gradient(logprobs) + jax.lax.stop_gradient(seq_log_ratio)[:, None]
        log_ratio = jnp.minimum(log_ratio, GSPO_LOG_RATIO_MAX)
    elif loss_algo != "grpo":
        raise ValueError(f"algo.loss_algo={loss_algo!r}: expected grpo or gspo-token")
    ratio = jnp.exp(log_ratio)
    adv = advantages.astype(jnp.float32)
    adv = adv[:, None] if adv.ndim == 1 else adv
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = jnp.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights.astype(jnp.float32)
    pg_loss = aggregate(per_token, mask, agg_mode, norm)
    loss = pg_loss
    taken = clipped > unclipped  # the clipped term is the larger loss: this token's gradient is cut
    metrics = {
        "pg_loss": pg_loss,
        "clip_fraction": _masked_mean(taken.astype(jnp.float32), mask, tokens),
        # which side cut it: the ratio fell below 1 - eps_low on a negative advantage, or rose above 1 + eps_high on
        # a positive one (clip-higher makes the two differ)
        "clip_fraction_low": _masked_mean((taken & (ratio < 1.0)).astype(jnp.float32), mask, tokens),
        "clip_fraction_high": _masked_mean((taken & (ratio > 1.0)).astype(jnp.float32), mask, tokens),
        "ratio_mean": _masked_mean(ratio, mask, tokens),
        "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0)),
        "ratio_min": jnp.min(jnp.where(mask > 0, ratio, jnp.inf)),
        "ppo_kl": ppo_kl,
    }
    if is_weights is not None:
        metrics["is_weight_mean"] = _masked_mean(is_weights, mask, tokens)
        metrics["is_weight_min"] = jnp.min(jnp.where(mask > 0, is_weights, jnp.inf))
    if ref_logprobs is not None:
        kl = kl_per_token(logprobs, ref_logprobs, kl_estimator)
        metrics["kl"] = _masked_mean(kl, mask, tokens)
        metrics["kl_loss"] = aggregate(kl, mask, agg_mode, norm)
        if beta:
            loss = loss + beta * metrics["kl_loss"]
    elif beta:
        raise ValueError("algo.beta > 0 needs reference logprobs")
    if entropy is not None:
        metrics["entropy"] = _masked_mean(jax.lax.stop_gradient(entropy), mask, tokens)
    return loss, metrics
