"""Hand-computed cases for every option of the objective."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.trainer_service.learning.loss import aggregate, kl_per_token, policy_loss, truncated_is_weights

BASE = dict(loss_algo="grpo", eps_low=0.2, eps_high=0.2, agg_mode="token-mean")


def test_on_policy_ratio_is_exactly_one_and_loss_is_minus_mean_advantage():
    lp = jnp.array([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    loss, m = policy_loss(lp, None, jnp.array([2.0, -1.0]), mask, **BASE)
    assert abs(float(loss) - (-(4 - 3) / 5)) < 1e-6
    assert float(m["ratio_min"]) == float(m["ratio_max"]) == 1.0 and float(m["clip_fraction"]) == 0


def test_asymmetric_clip_hand_computed():
    old = jnp.log(jnp.array([[0.5, 0.5]]))
    current = jnp.log(jnp.array([[0.8, 0.3]]))  # ratios 1.6 and 0.6
    mask = jnp.ones((1, 2))
    kw = dict(BASE, eps_high=0.28)
    loss, m = policy_loss(current, old, jnp.array([1.0]), mask, **kw)
    assert abs(float(loss) - (-(1.28 + 0.6) / 2)) < 1e-5  # A>0: min(1.6, 1.28), min(0.6, 0.8)
    assert abs(float(m["clip_fraction"]) - 0.5) < 1e-6
    loss_neg, _ = policy_loss(current, old, jnp.array([-1.0]), mask, **kw)
    assert abs(float(loss_neg) - (1.6 + 0.8) / 2) < 1e-5  # A<0: max(1.6, 1.28), max(0.6, 0.8)


def test_clipped_tokens_carry_no_gradient():
    old = jnp.log(jnp.array([[0.5, 0.5]]))
    g = jax.grad(lambda lp: policy_loss(lp, old, jnp.array([1.0]), jnp.ones((1, 2)), **BASE)[0])(
        jnp.log(jnp.array([[0.9, 0.55]])))  # ratio 1.8 (clipped), 1.1 (inside)
    assert float(g[0, 0]) == 0.0 and abs(float(g[0, 1]) - (-1.1 / 2)) < 1e-6


def test_gspo_token_uses_the_sequence_ratio_for_every_token():
    old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
    current = jnp.log(jnp.array([[0.8, 0.3, 0.9]]))
    mask = jnp.array([[1.0, 1.0, 0.0]])  # third token masked out of the sequence ratio
    seq_ratio = math.sqrt(1.6 * 0.6)  # geometric mean of the token ratios = 0.9798
    kw = dict(BASE, loss_algo="gspo-token")
    loss, m = policy_loss(current, old, jnp.array([1.0]), mask, **kw)
    assert abs(float(loss) + seq_ratio) < 1e-5
    assert abs(float(m["ratio_max"]) - seq_ratio) < 1e-5 and abs(float(m["ratio_min"]) - seq_ratio) < 1e-5
    g = jax.grad(lambda lp: policy_loss(lp, old, jnp.array([1.0]), mask, **kw)[0])(current)
    np.testing.assert_allclose(np.asarray(g), [[-seq_ratio / 2, -seq_ratio / 2, 0.0]], atol=1e-6)
    # clipping applies to the sequence ratio: 1.5 > 1.2 clips every token
    far = jnp.log(jnp.array([[0.75, 0.75, 0.1]]))
    loss_far, m_far = policy_loss(far, old, jnp.array([1.0]), mask, **kw)
    assert abs(float(loss_far) + 1.2) < 1e-5 and float(m_far["clip_fraction"]) == 1.0


def test_aggregation_modes_hand_computed():
    x = jnp.array([[4.0, 0.0, 0.0], [1.0, 1.0, 1.0], [9.0, 9.0, 9.0]])
    mask = jnp.array([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # last sequence empty
    assert float(aggregate(x, mask, "token-mean")) == pytest.approx(7 / 4)
    assert float(aggregate(x, mask, "sequence-mean-token-mean")) == pytest.approx((4 + 1) / 2)
    assert float(aggregate(x, mask, "sequence-mean-token-sum-norm")) == pytest.approx(7 / 2)  # Dr.GRPO
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate(x, mask, "sum")


def test_kl_estimators_hand_computed():
    lp, ref = jnp.array([[-1.0]]), jnp.array([[-1.5]])  # d = ref - lp = -0.5
    assert float(kl_per_token(lp, ref, "k1")[0, 0]) == pytest.approx(0.5)
    assert float(kl_per_token(lp, ref, "k2")[0, 0]) == pytest.approx(0.125)
    assert float(kl_per_token(lp, ref, "k3")[0, 0]) == pytest.approx(math.exp(-0.5) + 0.5 - 1)


def test_beta_adds_the_kl_term():
    lp = jnp.array([[-1.0, -2.0]])
    ref = jnp.array([[-1.5, -2.0]])
    mask = jnp.ones((1, 2))
    base, _ = policy_loss(lp, None, jnp.array([1.0]), mask, **BASE)
    with_kl, m = policy_loss(lp, None, jnp.array([1.0]), mask, **BASE, ref_logprobs=ref, beta=0.1,
                             kl_estimator="k1")
    assert float(m["kl"]) == pytest.approx(0.25) and float(with_kl - base) == pytest.approx(0.1 * 0.25)
    with pytest.raises(ValueError, match="beta"):
        policy_loss(lp, None, jnp.array([1.0]), mask, **BASE, beta=0.1)


def test_truncated_importance_weights_hand_computed():
    old = jnp.array([[-1.0, -1.0, -1.0]])
    behaviour = jnp.array([[-2.0, -0.5, -1.0]])
    w = truncated_is_weights(old, behaviour, cap=2.0)
    np.testing.assert_allclose(np.asarray(w), [[2.0, math.exp(-0.5), 1.0]], rtol=1e-6)  # e^1 capped at 2
    lp = jnp.array([[-1.0, -1.0, -1.0]])
    loss, m = policy_loss(lp, None, jnp.array([1.0]), jnp.ones((1, 3)), **BASE, is_weights=w)
    assert float(loss) == pytest.approx(-(2.0 + math.exp(-0.5) + 1.0) / 3, rel=1e-6)
    assert float(m["is_weight_min"]) == pytest.approx(math.exp(-0.5))
    # the weight is a constant for the gradient
    g = jax.grad(lambda o: truncated_is_weights(o, behaviour, 2.0).sum())(old)
    assert float(jnp.abs(g).sum()) == 0.0


def test_masked_tokens_do_not_matter():
    rng = np.random.default_rng()
    lp, old = jnp.asarray(-rng.random((3, 5))), jnp.asarray(-rng.random((3, 5)))
    mask = jnp.asarray((rng.random((3, 5)) > 0.4).astype(np.float32)).at[:, 0].set(1.0)
    adv = jnp.asarray(rng.standard_normal(3))
    for algo in ("grpo", "gspo-token"):
        kw = dict(BASE, loss_algo=algo)
        base, _ = policy_loss(lp, old, adv, mask, **kw)
        other, _ = policy_loss(jnp.where(mask > 0, lp, lp - 5.0), old, adv, mask, **kw)
        assert abs(float(base) - float(other)) < 1e-6


def test_the_entropy_metric_is_the_token_mean_whatever_the_aggregation():
    """Under Dr.GRPO's sum-norm aggregation the entropy reported was each sequence's summed entropy (about the
    completion length times larger): runs of different aggregations could not be compared."""
    entropy = jnp.array([[0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 0.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    lp = jnp.zeros((2, 4))
    for mode in ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm"):
        _, m = policy_loss(lp, lp, jnp.array([1.0, -1.0]), mask, **{**BASE, "agg_mode": mode}, entropy=entropy)
        assert float(m["entropy"]) == pytest.approx((4 * 0.5 + 2 * 1.0) / 6), mode
