import jax
import jax.numpy as jnp
import numpy as np

from trainer_service.loss import grpo_policy_loss


def test_on_policy_loss_is_minus_mean_advantage():
    lp = jnp.array([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]])
    mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = jnp.array([2.0, -1.0])
    loss, m = grpo_policy_loss(lp, lp, adv, mask, 0.2, 0.2)
    # ratio 1 everywhere: loss = -(2*2 + (-1)*3) / 5
    assert abs(float(loss) - (-(4 - 3) / 5)) < 1e-6
    assert float(m["clip_fraction"]) == 0 and abs(float(m["ratio_mean"]) - 1) < 1e-6


def test_clipping_hand_computed():
    behaviour = jnp.log(jnp.array([[0.5, 0.5]]))
    current = jnp.log(jnp.array([[0.8, 0.3]]))  # ratios 1.6 and 0.6
    mask = jnp.ones((1, 2))
    loss, m = grpo_policy_loss(current, behaviour, jnp.array([1.0]), mask, 0.2, 0.28)
    # positive advantage: min(1.6, 1.28) = 1.28 ; min(0.6, 0.8) = 0.6
    assert abs(float(loss) - (-(1.28 + 0.6) / 2)) < 1e-5
    assert abs(float(m["clip_fraction"]) - 0.5) < 1e-6
    loss_neg, _ = grpo_policy_loss(current, behaviour, jnp.array([-1.0]), mask, 0.2, 0.28)
    # negative advantage: -min(-1.6, -1.28) = 1.6 ; -min(-0.6, -0.8) = 0.8
    assert abs(float(loss_neg) - (1.6 + 0.8) / 2) < 1e-5


def test_clipped_tokens_carry_no_gradient():
    behaviour = jnp.log(jnp.array([[0.5, 0.5]]))
    mask = jnp.ones((1, 2))

    def f(current):
        return grpo_policy_loss(current, behaviour, jnp.array([1.0]), mask, 0.2, 0.2)[0]

    g = jax.grad(f)(jnp.log(jnp.array([[0.9, 0.55]])))  # ratio 1.8 (clipped), 1.1 (inside)
    assert float(g[0, 0]) == 0.0 and float(g[0, 1]) != 0.0


def test_masked_tokens_do_not_matter():
    rng = np.random.default_rng()
    lp = jnp.asarray(-rng.random((3, 5)))
    b = jnp.asarray(-rng.random((3, 5)))
    mask = jnp.asarray((rng.random((3, 5)) > 0.4).astype(np.float32))
    adv = jnp.asarray(rng.standard_normal(3))
    base, _ = grpo_policy_loss(lp, b, adv, mask, 0.2, 0.2)
    noisy = jnp.where(mask > 0, lp, lp - 50.0)
    other, _ = grpo_policy_loss(noisy, b, adv, mask, 0.2, 0.2)
    assert abs(float(base) - float(other)) < 1e-6
