"""Turning rollout groups into fixed-shape training batches.

Layout (identical to the sampler's): the prompt is left-padded to
P = generation.max_prompt_tokens, the completion follows and is
right-padded to C = generation.max_new_tokens. This is the step's data as
it travels (to trainer followers, to RUN_DIR/batches), in host (numpy)
arrays; each trainer process packs it on the host for the update, several
sequences to a row (packing.py), and places it on the mesh once.

A multi-turn completion holds observation tokens the environment wrote
between the model's turns (CompletionData.model_mask). They stay in the
sequence (the model reads them) but carry no loss and behaviour logprob 0, so
everything computed under the loss mask (the objective, GSPO's sequence
ratio, the sampler-trainer agreement, the off-policy diagnostics) sees model
tokens only, in this layout and in packed rows.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from flax import struct

from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.rollouts.wire import GroupData
from grpo_stream.trainer_service.learning.advantages import compute_advantages, overlong_penalty


@struct.dataclass
class TrainBatch:
    """One optimizer step's data, host arrays; targets are aligned with logprob positions (length L-1)."""

    tokens: np.ndarray              # [B, L] int32
    valid: np.ndarray               # [B, L] bool, real (non-pad) tokens
    loss_mask: np.ndarray           # [B, L-1] float32, 1 where the target is a model-sampled completion token that
                                    # counts (0 on observation tokens, and on a filtered sequence's)
    behaviour_logprobs: np.ndarray  # [B, L-1] float32, sampler logprobs at the same positions
    advantages: np.ndarray          # [B] float32
    fresh: np.ndarray               # [B] float32, 1 for sequences made with exactly the weights being updated


def training_rewards(rewards: np.ndarray, lengths: np.ndarray, algo: AlgoSection, max_new: int) -> np.ndarray:
    """The rewards advantages are computed from: the task's, plus DAPO's overlong penalty with algo.overlong=penalty
    (float32, the shape of `rewards`)."""
    rewards = np.asarray(rewards, np.float32)
    if algo.overlong == "penalty":
        rewards = rewards + overlong_penalty(lengths, max_new, algo.overlong_buffer_tokens, algo.overlong_penalty)
    return rewards


def without_signal(group: GroupData, algo: AlgoSection, max_new: int) -> bool:
    """Whether a group gives the loss nothing: its training rewards are all equal, so its advantages are all zero.
    With the overlong penalty, equally correct answers of different lengths inside the penalty's ramp are a signal
    (their lengths). With algo.overlong=filter only the completions not truncated are in the loss: a group is without
    signal when none of them has a non-zero advantage (every completion truncated, say), whatever the truncated ones
    got (every estimator's advantage is zero exactly where the reward is the group's mean)."""
    lengths = np.array([len(c.token_ids) for c in group.completions])
    rewards = training_rewards(group.rewards, lengths, algo, max_new)
    if np.ptp(rewards) == 0:
        return True
    if algo.overlong != "filter":
        return False
    kept = ~np.array([c.truncated for c in group.completions], np.bool_)
    rewards = rewards.astype(np.float64)  # as advantages.py computes the mean
    return not bool(np.any(kept & (rewards != rewards.mean())))


def no_signal_test(algo: AlgoSection, max_new: int) -> Callable[[GroupData], bool] | None:
    """algo.dynamic_sampling's test of a group (`without_signal`), None when it is off."""
    return (lambda group: without_signal(group, algo, max_new)) if algo.dynamic_sampling else None


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


def build_batch(groups: list[GroupData], max_prompt: int, max_new: int, pad_id: int, algo: AlgoSection,
                held_version: int) -> tuple[TrainBatch, dict[str, float]]:
    """Stack groups into a TrainBatch (advantages, overlong handling) and return batch statistics.

    `held_version` is the weight version the trainer holds now; groups made with it are `fresh`.
    """
    n = len(groups[0].completions)
    lengths = np.array([[len(c.token_ids) for c in g.completions] for g in groups])
    rewards = training_rewards(np.stack([g.rewards for g in groups]), lengths, algo, max_new)
    truncated = np.array([[c.truncated for c in g.completions] for g in groups])
    advantages = compute_advantages(rewards, algo.advantage_estimator, algo.advantage_eps).reshape(-1)
    keep = ~(truncated.reshape(-1)) if algo.overlong == "filter" else np.ones(len(groups) * n, np.bool_)
    rows = [(g.prompt_token_ids, c) for g in groups for c in g.completions]
    length = max_prompt + max_new
    tokens = np.zeros((len(rows), length), np.int32)
    valid = np.zeros((len(rows), length), np.bool_)
    loss_mask = np.zeros((len(rows), length - 1), np.float32)
    behaviour = np.zeros((len(rows), length - 1), np.float32)
    model_tokens = 0
    for i, (prompt, c) in enumerate(rows):
        tokens[i], valid[i] = layout(prompt, c.token_ids, max_prompt, max_new, pad_id)
        k, model = len(c.token_ids), c.model_tokens()
        model_tokens += int(model.sum())
        # target position t predicts tokens[t + 1]; completion tokens sit at P..P+k-1; observation tokens take no loss
        loss_mask[i, max_prompt - 1:max_prompt - 1 + k] = model * float(keep[i])
        behaviour[i, max_prompt - 1:max_prompt - 1 + k] = np.where(model, c.logprobs, 0.0)
    fresh = np.repeat([g.policy_version == held_version for g in groups], n).astype(np.float32)
    stats = {
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
        "advantage_mean": float(advantages.mean()), "advantage_abs_mean": float(np.abs(advantages).mean()),
        "advantage_max": float(advantages.max()), "advantage_min": float(advantages.min()),
        "response_length_mean": float(lengths.mean()), "truncated_fraction": float(truncated.mean()),
        # the share of completion tokens the model sampled (1.0 single-turn; the rest are observation tokens)
        "model_token_fraction": model_tokens / max(int(lengths.sum()), 1),
        # the share of the laid-out tokens that are padding: what every sequence at max_prompt + max_new costs the
        # update's forward and backward passes
        "padding_fraction": float(1.0 - valid.sum() / valid.size), "real_tokens": int(valid.sum()),
    }
    # host arrays: the update packs them on the host and places the packed rows once (no round trip via a device)
    batch = TrainBatch(tokens=tokens, valid=valid, loss_mask=loss_mask, behaviour_logprobs=behaviour,
                       advantages=advantages.astype(np.float32), fresh=fresh)
    return batch, stats
