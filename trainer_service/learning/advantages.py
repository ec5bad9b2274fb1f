"""Group-relative advantage estimators and reward shaping (pure numpy).

GRPO-family methods replace a learned value baseline with statistics of the
group of completions sampled for the same prompt. All functions take rewards
as [groups, num_generations].
"""

from __future__ import annotations

import numpy as np


def _check(rewards) -> np.ndarray:
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, num_generations>=2], got shape {rewards.shape}")
    return rewards


def grpo_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """A_i = (r_i - mean(r)) / (std(r) + eps) per group; std is unbiased (ddof=1), as in Tunix.

    Zero-variance groups get all-zero advantages.
    """
    rewards = _check(rewards)
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, ddof=1, keepdims=True)
    return ((rewards - mean) / (std + eps)).astype(np.float32)


def drgrpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """Dr.GRPO: A_i = r_i - mean(r); no division by the std, which over-weights easy and hard prompts."""
    rewards = _check(rewards)
    return (rewards - rewards.mean(axis=1, keepdims=True)).astype(np.float32)


def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    """RLOO: A_i = r_i - mean of the other n-1 rewards of the group (an unbiased baseline)."""
    rewards = _check(rewards)
    n = rewards.shape[1]
    others = (rewards.sum(axis=1, keepdims=True) - rewards) / (n - 1)
    return (rewards - others).astype(np.float32)


def compute_advantages(rewards: np.ndarray, estimator: str, eps: float) -> np.ndarray:
    if estimator == "grpo":
        return grpo_advantages(rewards, eps)
    if estimator == "drgrpo":
        return drgrpo_advantages(rewards)
    if estimator == "rloo":
        return rloo_advantages(rewards)
    raise ValueError(f"algo.advantage_estimator={estimator!r}: expected grpo, drgrpo or rloo")


def overlong_penalty(lengths: np.ndarray, max_new_tokens: int, buffer_tokens: int, penalty: float) -> np.ndarray:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer_tokens, then linear to -penalty."""
    excess = np.asarray(lengths, np.float64) - (max_new_tokens - buffer_tokens)
    return (-penalty * np.clip(excess / buffer_tokens, 0.0, 1.0)).astype(np.float32)
