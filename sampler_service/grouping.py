"""Turning one generation batch into scored rollout groups (one per prompt)."""

from __future__ import annotations

import time
from typing import Iterator

from common.generation import Generation
from common.rewards import RewardSet
from common.tasks.arith import Problem
from common.tokenizer import TextTokenizer
from common.wire import CompletionData, GroupData


def build_groups(batch: list[tuple[Problem, list[int]]], out: Generation, num_generations: int,
                 tokenizer: TextTokenizer, rewards: RewardSet, policy_version: int, sampler_id: str,
                 group_ids: list[str], positions: list[int] | None = None) -> Iterator[GroupData]:
    """Rows k*n .. (k+1)*n-1 of `out` are the completions of batch[k]; yields one scored group per prompt, with
    id group_ids[k] and data position positions[k] (its prompt's index in the sampler's stream)."""
    n = num_generations
    if out.tokens.shape[0] != len(batch) * n:
        raise ValueError(f"{out.tokens.shape[0]} completions for {len(batch)} prompts x {n} generations")
    if len(group_ids) != len(batch) or (positions is not None and len(positions) != len(batch)):
        raise ValueError(f"{len(batch)} prompts need as many group ids and positions")
    for k, (problem, prompt_ids) in enumerate(batch):
        completions = []
        for j in range(k * n, (k + 1) * n):
            length = int(out.lengths[j])
            tokens = out.tokens[j, :length]
            reward, parts = rewards.score(tokenizer.decode(tokens.tolist()), problem.answer)
            completions.append(CompletionData(token_ids=tokens, logprobs=out.logprobs[j, :length], reward=reward,
                                              truncated=not bool(out.finished[j]), reward_components=parts))
        yield GroupData(group_id=group_ids[k], prompt_id=problem.prompt_id, prompt_token_ids=prompt_ids,
                        completions=completions, policy_version=policy_version, sampler_id=sampler_id,
                        created_unix=time.time(), reference_answer=problem.answer,
                        data_position=None if positions is None else positions[k])
