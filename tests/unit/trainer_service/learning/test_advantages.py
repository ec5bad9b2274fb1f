import numpy as np
import pytest
from tunix.rl import algo_core

from grpo_stream.common.rollouts.wire import MAX_ABS_REWARD
from grpo_stream.trainer_service.learning.advantages import compute_advantages, grpo_advantages


def test_hand_computed():
    adv = grpo_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    # mean 0.5, unbiased std = sqrt(1/3)
    np.testing.assert_allclose(adv, [[0.8660254, -0.8660254, -0.8660254, 0.8660254]], rtol=1e-6)


def test_zero_variance_group_gets_zero_advantage():
    adv = grpo_advantages(np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.5]]))
    assert (adv[0] == 0).all() and abs(adv[1].sum()) < 1e-5


def test_matches_tunix_reference():
    rng = np.random.default_rng()
    rewards = rng.random((5, 6)).astype(np.float32)
    ours = grpo_advantages(rewards, eps=1e-6).reshape(-1)
    ref = algo_core.compute_advantages(rewards.reshape(-1), num_generations=6)
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)


def test_shape_is_checked():
    with pytest.raises(ValueError, match="num_generations>=2"):
        grpo_advantages(np.zeros((3, 1)))


def test_drgrpo_and_rloo_hand_computed():
    from grpo_stream.trainer_service.learning.advantages import compute_advantages

    r = np.array([[1.0, 0.0, 0.0, 1.0]])
    np.testing.assert_allclose(compute_advantages(r, "drgrpo", 1e-6), [[0.5, -0.5, -0.5, 0.5]])
    # RLOO: 1 - (1/3), 0 - (2/3)
    np.testing.assert_allclose(compute_advantages(r, "rloo", 1e-6), [[2 / 3, -2 / 3, -2 / 3, 2 / 3]], rtol=1e-6)
    with pytest.raises(ValueError, match="advantage_estimator"):
        compute_advantages(r, "ppo", 1e-6)


def test_drgrpo_and_rloo_match_tunix():
    from grpo_stream.trainer_service.learning.advantages import drgrpo_advantages, rloo_advantages

    rewards = np.random.default_rng().random((4, 5)).astype(np.float32)
    np.testing.assert_allclose(drgrpo_advantages(rewards).reshape(-1),
                               algo_core.compute_drgrpo_advantages(rewards.reshape(-1), 5), atol=1e-6)
    np.testing.assert_allclose(rloo_advantages(rewards).reshape(-1),
                               np.asarray(algo_core.compute_rloo_advantages(rewards.reshape(-1), 5)), atol=1e-6)


def test_overlong_penalty_ramp():
    from grpo_stream.trainer_service.learning.advantages import overlong_penalty

    np.testing.assert_allclose(overlong_penalty(np.array([1, 6, 7, 8, 9]), 8, 2, 1.0), [0, 0, -0.5, -1, -1])


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_rewards_within_the_ingest_bound_give_finite_advantages(estimator):
    """The ingest's reward bound (wire.MAX_ABS_REWARD) is what keeps every estimator's float32 result finite: a
    float32 reward of 3e38, which it used to pass, made drgrpo's and rloo's advantages inf."""
    rewards = np.array([[MAX_ABS_REWARD, -MAX_ABS_REWARD, -MAX_ABS_REWARD, -MAX_ABS_REWARD]], np.float32)
    advantages = compute_advantages(rewards, estimator, 1e-6)
    assert advantages.dtype == np.float32 and np.isfinite(advantages).all()
