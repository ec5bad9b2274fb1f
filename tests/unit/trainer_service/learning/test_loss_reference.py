"""The objective (loss.policy_loss) against a plain-numpy derivation of the published definitions, value and
gradient with respect to the trained log-probs: GRPO's clipped token ratio (DeepSeekMath), GSPO-token's sequence
ratio, the geometric mean of the token ratios against the sampler's policy (Zheng et al. 2025), clip-higher (DAPO),
truncated importance weights, the k1/k2/k3 KL to a reference, per-sequence or per-token (distillation) advantages,
and the three aggregations, with an empty row and masked tokens. Independent of Tunix (test_tunix_parity.py) and of
the hand cases of test_loss.py: the gradient is written out by hand here, not taken by autodiff."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.trainer_service.learning.loss import AGG_MODES, kl_per_token, policy_loss

ESTIMATORS = ("k1", "k2", "k3")


def numpy_objective(l, base, adv, mask, algo, eps_low, eps_high, agg, weights, ref, beta, estimator):
    """(loss, d loss / d l) of the objective, in float64, from the formulas of docs/objective.md."""
    adv = np.broadcast_to(adv[:, None], l.shape) if adv.ndim == 1 else adv
    tokens = mask.sum(axis=1)
    log_ratio = np.clip(l - base, -20.0, 20.0)
    if algo == "grpo":
        ratio = np.exp(log_ratio)
        d_ratio = ratio * (np.abs(l - base) < 20.0)  # the +-20 clip of the log-ratio passes no gradient
    else:  # one ratio a sequence; each token's gradient is the ratio times its own log-prob's gradient
        seq = np.minimum((log_ratio * mask).sum(axis=1) / np.maximum(tokens, 1.0), 10.0)
        ratio = np.broadcast_to(np.exp(seq)[:, None], l.shape)
        d_ratio = ratio * (seq < 10.0)[:, None]
    unclipped, clipped = -adv * ratio, -adv * np.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    inside = (ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high)
    per_token = np.maximum(unclipped, clipped) * weights
    d_per_token = np.where((unclipped >= clipped) | inside, -adv * d_ratio, 0.0) * weights
    d = ref - l
    per_token = per_token + beta * {"k1": -d, "k2": d * d / 2, "k3": np.exp(d) - d - 1}[estimator]
    d_per_token = d_per_token + beta * {"k1": 1.0, "k2": -d, "k3": 1.0 - np.exp(d)}[estimator]
    sequences = max(float((tokens > 0).sum()), 1.0)
    if agg == "token-mean":
        share = mask / max(mask.sum(), 1.0)
    elif agg == "sequence-mean-token-mean":
        share = mask / np.maximum(tokens, 1.0)[:, None] / sequences
    else:
        share = mask / sequences
    return float((per_token * share).sum()), d_per_token * share


@pytest.mark.parametrize("algo,agg", list(itertools.product(("grpo", "gspo-token"), AGG_MODES)))
def test_loss_and_gradient_equal_the_numpy_derivation(algo, agg):
    rng = np.random.default_rng([("grpo", "gspo-token").index(algo), AGG_MODES.index(agg)])
    b, t = 6, 9
    eps_low, eps_high = (0.2, 0.28) if algo == "grpo" else (3e-4, 4e-4)
    for case, (per_token_adv, tis, estimator) in enumerate(itertools.product((False, True), (False, True),
                                                                             ESTIMATORS)):
        l = rng.normal(-2.0, 1.0, (b, t))
        # ratios on both sides of the clip range: GRPO's token ratios, GSPO's sequence ratios
        base = l + rng.normal(0.0, 0.3 if algo == "grpo" else 6e-4, (b, t))
        mask = (rng.random((b, t)) < 0.7).astype(np.float64)
        mask[2] = 0.0  # an empty sequence counts in no denominator
        adv = rng.normal(size=(b, t) if per_token_adv else b)
        weights = rng.uniform(0.2, 2.0, (b, t)) if tis else np.ones((b, t))
        ref = l + rng.normal(0.0, 0.5, (b, t))
        expected, expected_grad = numpy_objective(l, base, adv, mask, algo, eps_low, eps_high, agg, weights, ref,
                                                  0.3, estimator)
        f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
        loss, grad = jax.value_and_grad(lambda x: policy_loss(
            x, f32(base), f32(adv), f32(mask), loss_algo=algo, eps_low=eps_low, eps_high=eps_high, agg_mode=agg,
            is_weights=f32(weights) if tis else None, ref_logprobs=f32(ref), beta=0.3, kl_estimator=estimator)[0])(
                f32(l))
        assert abs(float(loss) - expected) <= 1e-5 * max(1.0, abs(expected)), (case, float(loss), expected)
        np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-4,
                                   atol=1e-6 * np.abs(expected_grad).max(), err_msg=f"case {case}")


def test_the_documented_ratio_limits_are_applied():
    """Token log-ratios beyond +-20 and GSPO sequence log-ratios beyond 10 are clipped: finite loss, no gradient
    through the clipped value (negative advantages, so the clip range of the objective itself never cuts)."""
    mask, adv = jnp.ones((1, 3)), jnp.array([-1.0])
    kw = dict(eps_low=0.2, eps_high=0.2, agg_mode="token-mean")
    # GRPO: token log-ratios 29 (clipped to 20), 0.5 and 0
    l, base = jnp.array([[-1.0, -1.0, -2.0]]), jnp.array([[-30.0, -1.5, -2.0]])
    loss, grad = jax.value_and_grad(lambda x: policy_loss(x, base, adv, mask, loss_algo="grpo", **kw)[0])(l)
    np.testing.assert_allclose(float(loss), (np.exp(20.0) + np.exp(0.5) + 1.0) / 3, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), [[0.0, np.exp(0.5) / 3, 1.0 / 3]], rtol=1e-5)
    # GSPO: the sequence log-ratio (20 + 0.5 + 0) / 3 is under the cap of 10: every token has the ratio's gradient
    loss, grad = jax.value_and_grad(lambda x: policy_loss(x, base, adv, mask, loss_algo="gspo-token", **kw)[0])(l)
    ratio = np.exp(20.5 / 3)
    np.testing.assert_allclose(float(loss), ratio, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), np.full((1, 3), ratio / 3), rtol=1e-5)
    # GSPO: a sequence log-ratio of 12 is capped at 10, and the capped sequence has no gradient
    loss, grad = jax.value_and_grad(lambda x: policy_loss(x, jnp.full((1, 3), -13.0), adv, mask,
                                                          loss_algo="gspo-token", **kw)[0])(jnp.full((1, 3), -1.0))
    np.testing.assert_allclose(float(loss), np.exp(10.0), rtol=1e-5)
    assert (np.asarray(grad) == 0.0).all()


def test_k3_stays_finite_where_the_policy_falls_far_below_the_reference():
    """k3 = e^d - d - 1 with d = ref - policy: a token the policy holds 90 nats below the reference overflowed
    float32 (loss inf, gradient -inf, the update after clipping and Adam NaN). Past d = 20 e^d goes on as its
    tangent: equal below, finite and still pulling the policy up above."""
    ref = jnp.array([[-5.0, -1.0, -1.0]])
    policy = jnp.array([[-95.0, -1.0, -10.0]])  # d = 90, 0, 9
    k3 = kl_per_token(policy, ref, "k3")
    e20 = np.exp(20.0)
    np.testing.assert_allclose(np.asarray(k3), [[e20 * (1 + 70) - 91, 0.0, np.exp(9.0) - 10]], rtol=1e-5)
    grad = jax.grad(lambda x: kl_per_token(x, ref, "k3").sum())(policy)
    np.testing.assert_allclose(np.asarray(grad), [[1 - e20, 0.0, 1 - np.exp(9.0)]], rtol=1e-5)
    assert np.isfinite(np.asarray(grad)).all() and float(grad[0, 0]) < 0  # raising the policy lowers the KL
