"""Group-relative advantage estimators (pure numpy).

GRPO replaces a learned value baseline with the statistics of the group of
completions sampled for the same prompt.
"""

from __future__ import annotations

import numpy as np


def grpo_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """A_i = (r_i - mean(r)) / (std(r) + eps), per group.

    Args:
      rewards: [groups, num_generations] total reward of each completion.
      eps: keeps zero-variance groups finite (their advantages are all 0).

    Returns:
      [groups, num_generations] float32. The std is the unbiased one
      (ddof=1), as in the GRPO paper's reference code and Tunix.
    """
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, num_generations>=2], got shape {rewards.shape}")
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, ddof=1, keepdims=True)
    return ((rewards - mean) / (std + eps)).astype(np.float32)


def zero_variance_groups(rewards: np.ndarray) -> np.ndarray:
    """[groups] bool: groups whose completions all got the same reward (no learning signal)."""
    rewards = np.asarray(rewards)
    return np.all(rewards == rewards[:, :1], axis=1)
