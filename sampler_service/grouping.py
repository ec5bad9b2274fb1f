"""Turning one generation batch into scored rollout groups (one per prompt)."""

from __future__ import annotations

import time
from typing import Iterator

from grpo_stream.common.engine.base import Generation
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.common.tasks.arith import Problem
from grpo_stream.common.model.tokenizer import TextTokenizer
from grpo_stream.common.rollouts.wire import CompletionData, GroupData


def build_groups(batch: list[tuple[Problem, list[int]]], out: Generation, num_generations: int,
                 tokenizer: TextTokenizer, rewards: RewardSet, policy_version: int, sampler_id: str,
                 group_ids: list[str], positions: list[int | None] | None = None, sizes: list[int] | None = None,
                 reward_sets: list[RewardSet] | None = None, injected: list[bool] | None = None
                 ) -> Iterator[GroupData]:
    """The completions of batch[k] are the next sizes[k] rows of `out` (default: num_generations each; rows past
    the last prompt's are padding and ignored); yields one scored group per prompt (at `policy_version`, or, where
    `out.versions` records versions per token, at its oldest token's), with id group_ids[k], data
    position positions[k] (its prompt's index in the sampler's stream, None for an injected prompt), scored by
    reward_sets[k] (default: `rewards`) and flagged injected[k]."""
    padded = sizes is not None
    sizes = sizes or [num_generations] * len(batch)
    if out.tokens.shape[0] < sum(sizes) or (not padded and out.tokens.shape[0] != sum(sizes)):
        raise ValueError(f"{out.tokens.shape[0]} completions for {len(batch)} prompts x "
                         f"{sizes[0] if len(set(sizes)) == 1 else sizes} generations")
    if len(group_ids) != len(batch) or (positions is not None and len(positions) != len(batch)) or \
            len(sizes) != len(batch):
        raise ValueError(f"{len(batch)} prompts need as many group ids, positions and sizes")
    start = 0
    for k, (problem, prompt_ids) in enumerate(batch):
        completions = []
        scorer = rewards if reward_sets is None else reward_sets[k]
        for j in range(start, start + sizes[k]):
            length = int(out.lengths[j])
            tokens = out.tokens[j, :length]
            reward, parts = scorer.score(tokenizer.decode(tokens.tolist()), problem.answer)
            completions.append(CompletionData(token_ids=tokens, logprobs=out.logprobs[j, :length], reward=reward,
                                              truncated=not bool(out.finished[j]), reward_components=parts,
                                              versions=None if out.versions is None else out.versions[j, :length]))
        start += sizes[k]
        # with in-flight updates the completions mix versions: the group is as stale as its oldest token
        drawn = [c.versions for c in completions if c.versions is not None and len(c.versions)]
        version = int(min(v.min() for v in drawn)) if drawn else policy_version
        yield GroupData(group_id=group_ids[k], prompt_id=problem.prompt_id, prompt_token_ids=prompt_ids,
                        completions=completions, policy_version=version, sampler_id=sampler_id,
                        created_unix=time.time(), reference_answer=problem.answer,
                        data_position=None if positions is None else positions[k],
                        injected=bool(injected and injected[k]))
