"""The clipped GRPO policy objective with behaviour-policy importance ratios.

For completion token t of sequence i, with advantage A_i (shared by all its
tokens), current-policy logprob l_it and the sampler's behaviour logprob b_it:

    r_it   = exp(l_it - b_it)
    L_it   = -min(r_it * A_i, clip(r_it, 1 - eps_low, 1 + eps_high) * A_i)
    loss   = sum_it m_it L_it / sum_it m_it          ("token-mean")

where m_it masks completion tokens. Because b_it comes from the policy
version that generated the group, which may lag the trainer by up to
`trainer.max_staleness` steps, r_it is the off-policy importance ratio and
the clip bounds how far one update moves probabilities on stale data.
"""

from __future__ import annotations

import jax.numpy as jnp


def grpo_policy_loss(logprobs: jnp.ndarray, behaviour_logprobs: jnp.ndarray, advantages: jnp.ndarray,
                     mask: jnp.ndarray, eps_low: float, eps_high: float) -> tuple[jnp.ndarray, dict]:
    """Token-mean clipped surrogate (see module docstring).

    Args:
      logprobs: [B, T] current-policy logprobs of the sampled tokens.
      behaviour_logprobs: [B, T] the sampler's logprobs of the same tokens.
      advantages: [B] per-sequence advantages.
      mask: [B, T] 1.0 on completion tokens, 0.0 elsewhere.
      eps_low, eps_high: clip range [1 - eps_low, 1 + eps_high].

    Returns:
      (scalar loss, metrics) with metrics: clip_fraction, ratio_mean, ratio_max,
      and approx_kl (mean of (r - 1) - log r, the k3 estimator of KL(behaviour || current)).
    """
    log_ratio = jnp.where(mask > 0, logprobs - behaviour_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    per_token = -jnp.minimum(unclipped, clipped)
    denom = jnp.maximum(mask.sum(), 1.0)
    loss = (per_token * mask).sum() / denom
    metrics = {
        "clip_fraction": ((clipped < unclipped) * mask).sum() / denom,
        "ratio_mean": (ratio * mask).sum() / denom,
        "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0)),
        "approx_kl": (((ratio - 1.0) - log_ratio) * mask).sum() / denom,
    }
    return loss, metrics
