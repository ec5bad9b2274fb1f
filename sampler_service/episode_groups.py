"""A generation batch of multi-turn episodes as scored rollout groups (environment.name set)."""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from grpo_stream.common.environments.episodes import EpisodeResult
from grpo_stream.common.rollouts.wire import CompletionData, GroupData

TURN_REWARD = "turn_reward"  # reward component: the weighted sum of an episode's per-turn rewards


def completion_of(result: EpisodeResult, scorer, answer: str, turn_weight: float) -> CompletionData:
    """One episode as a completion: its tokens with the model/observation mask, scored on its model turns' text."""
    reward, parts = scorer.score(result.model_text, answer)
    if result.turn_rewards:
        turn = turn_weight * float(sum(result.turn_rewards))
        reward, parts = reward + turn, {**parts, TURN_REWARD: turn}
    return CompletionData(token_ids=np.asarray(result.tokens, np.int32),
                          logprobs=np.asarray(result.logprobs, np.float32), reward=float(reward),
                          truncated=not result.finished, reward_components=parts,
                          versions=np.asarray(result.versions, np.int64) if result.versions else None,
                          model_mask=np.asarray(result.model_mask, np.bool_))


def episode_groups(slots, results: list[EpisodeResult], policy_version: int, sampler_id: str,
                   turn_weight: float) -> Iterator[GroupData]:
    """The episodes of each slot (slot.rows consecutive results) as one group; the group is as stale as its oldest
    token."""
    start = 0
    for slot in slots:
        completions = [completion_of(r, slot.rewards, slot.problem.answer, turn_weight)
                       for r in results[start:start + slot.rows]]
        start += slot.rows
        drawn = [c.versions for c in completions if c.versions is not None and len(c.versions)]
        version = int(min(v.min() for v in drawn)) if drawn else policy_version
        yield GroupData(group_id=slot.group_id, prompt_id=slot.problem.prompt_id, prompt_token_ids=slot.ids,
                        completions=completions, policy_version=version, sampler_id=sampler_id,
                        created_unix=time.time(), reference_answer=slot.problem.answer, data_position=slot.position,
                        injected=slot.position is None)
