"""Turning rollout groups into fixed-shape training batches.

Layout (identical to the sampler's): the prompt is left-padded to
P = generation.max_prompt_tokens, the completion follows and is
right-padded to C = generation.max_new_tokens. Fixed shapes mean one
compiled train step for the whole run.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct

from common.wire import GroupData
from trainer_service.advantages import grpo_advantages


@struct.dataclass
class TrainBatch:
    """One optimizer step's data; targets are aligned with logprob positions (length L-1)."""

    tokens: jnp.ndarray              # [B, L] int32
    valid: jnp.ndarray               # [B, L] bool, real (non-pad) tokens
    loss_mask: jnp.ndarray           # [B, L-1] float32, 1 where the target is a completion token
    behaviour_logprobs: jnp.ndarray  # [B, L-1] float32, sampler logprobs at the same positions
    advantages: jnp.ndarray          # [B] float32


def layout(prompt: np.ndarray, completion: np.ndarray, max_prompt: int, max_new: int, pad_id: int):
    """(tokens [L], valid [L]) for one sequence in the shared layout."""
    if not 0 < len(prompt) <= max_prompt or len(completion) > max_new:
        raise ValueError(f"sequence of {len(prompt)}+{len(completion)} tokens does not fit {max_prompt}+{max_new}")
    tokens = np.full(max_prompt + max_new, pad_id, np.int32)
    valid = np.zeros(max_prompt + max_new, np.bool_)
    tokens[max_prompt - len(prompt):max_prompt] = prompt
    tokens[max_prompt:max_prompt + len(completion)] = completion
    valid[max_prompt - len(prompt):max_prompt + len(completion)] = True
    return tokens, valid


def build_batch(groups: list[GroupData], max_prompt: int, max_new: int, pad_id: int,
                advantage_eps: float) -> tuple[TrainBatch, dict[str, float]]:
    """Stack groups into a TrainBatch and return batch statistics (rewards, advantages, lengths)."""
    rewards = np.stack([g.rewards for g in groups])
    advantages = grpo_advantages(rewards, advantage_eps)
    rows = [(g.prompt_token_ids, c) for g in groups for c in g.completions]
    length = max_prompt + max_new
    tokens = np.zeros((len(rows), length), np.int32)
    valid = np.zeros((len(rows), length), np.bool_)
    loss_mask = np.zeros((len(rows), length - 1), np.float32)
    behaviour = np.zeros((len(rows), length - 1), np.float32)
    for i, (prompt, c) in enumerate(rows):
        tokens[i], valid[i] = layout(prompt, c.token_ids, max_prompt, max_new, pad_id)
        n = len(c.token_ids)
        # target position t predicts tokens[t + 1]; completion tokens sit at P..P+n-1
        loss_mask[i, max_prompt - 1:max_prompt - 1 + n] = 1.0
        behaviour[i, max_prompt - 1:max_prompt - 1 + n] = c.logprobs
    stats = {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        "advantage_mean": float(advantages.mean()), "advantage_abs_mean": float(np.abs(advantages).mean()),
        "response_length_mean": float(loss_mask.sum(axis=1).mean()),
    }
    batch = TrainBatch(tokens=jnp.asarray(tokens), valid=jnp.asarray(valid), loss_mask=jnp.asarray(loss_mask),
                       behaviour_logprobs=jnp.asarray(behaviour), advantages=jnp.asarray(advantages.reshape(-1)))
    return batch, stats
