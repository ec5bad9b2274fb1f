"""The one group builder: a group's finished episodes as the wire's GroupData, whatever kind of rollout made them.

- Rewards: an episode its kind scored (a verifiers rubric: `EpisodeResult.reward`) keeps that reward and its
  components; any other is scored by the group's reward set on its final model turn's text (`answer_text`; a
  single-turn completion: its one turn), plus `turn_weight` x the sum of its per-turn rewards (component
  `turn_reward`). Earlier turns are not the answer: they hold guesses made before a tool answered and the tools'
  calls (code that prints `#### 75`), which would otherwise outrank the final answer (the first statement wins,
  common/tasks/answers.py). Every reward, format ones too, reads that same text, read as a single-turn completion's.
- Versions: a group is as stale as its oldest token. Tokens record the version that drew them; a completion whose
  tokens all have the group's version carries no per-token versions on the wire (wire.to_proto), one that mixes
  versions (in-flight weight updates) carries them, and the trainer weighs each token by its own.
- Truncation: an episode that did not end by a stop token or its environment is truncated.
This runs off the engine's thread (the sampler's scorer), never inside `finish`.
"""

from __future__ import annotations

import time

import numpy as np

from grpo_stream.common.episodes.result import EpisodeResult, GroupWork
from grpo_stream.common.rollouts.wire import CompletionData, GroupData

TURN_REWARD = "turn_reward"  # reward component: the weighted sum of an episode's per-turn rewards


def group_version(results: list[EpisodeResult], fallback: int) -> int:
    """The version a group counts as: its oldest token's (`fallback` when no token recorded one)."""
    drawn = [min(r.versions) for r in results if r.versions]
    return int(min(drawn)) if drawn else fallback


def episode_text(result: EpisodeResult, tokenizer) -> str:
    """What the model wrote in an episode (to show it): its turns' texts, or its model tokens decoded."""
    if result.turn_texts:
        return result.model_text
    return tokenizer.decode([t for t, m in zip(result.tokens, result.model_mask) if m])


def answer_text(result: EpisodeResult, tokenizer) -> str:
    """What the run's rewards score (module docstring): the final model turn's text; an episode whose turns were not
    decoded one by one (single-turn, whose one turn it is; a verifiers rollout, which its rubric scores) as a
    whole."""
    if result.turn_texts:
        return result.turn_texts[-1]
    return episode_text(result, tokenizer)


def score_episode(result: EpisodeResult, work: GroupWork, tokenizer, turn_weight: float,
                  call=None) -> tuple[float, dict]:
    """(reward, components) of one episode (module docstring); one that failed to become a completion scores 0.
    `call`: how each reward runs (RewardSet.score; a sampler's: in a worker with a deadline)."""
    if result.failed:
        return 0.0, {}
    if result.reward is not None:
        return float(result.reward), dict(result.reward_components)
    reward, parts = work.rewards.score(answer_text(result, tokenizer), work.problem.answer, call)
    if result.turn_rewards:
        turn = turn_weight * float(sum(result.turn_rewards))
        reward, parts = reward + turn, {**parts, TURN_REWARD: turn}
    return float(reward), parts


def build_group(work: GroupWork, results: list[EpisodeResult], sampler_id: str, tokenizer, turn_weight: float = 0.0,
                fallback_version: int = 0, call=None) -> GroupData:
    """`work`'s group from its episodes (one per row, in row order); `call`: as score_episode's."""
    if len(results) != work.rows:
        raise ValueError(f"group {work.group_id}: {len(results)} episodes for {work.rows} rows")
    completions = []
    for result in results:
        reward, parts = score_episode(result, work, tokenizer, turn_weight, call)
        completions.append(CompletionData(
            token_ids=np.asarray(result.tokens, np.int32), logprobs=np.asarray(result.logprobs, np.float32),
            reward=reward, truncated=not result.finished, reward_components=parts,
            versions=np.asarray(result.versions, np.int64) if result.versions else None,
            model_mask=np.asarray(result.model_mask, np.bool_)))
    prompts = {tuple(r.prompt_ids) for r in results if r.prompt_ids is not None}
    if len(prompts) > 1:
        raise ValueError(f"group {work.group_id}: its episodes started from different prompt ids")
    prompt_ids = list(prompts.pop()) if prompts else list(work.prompt_ids)
    return GroupData(group_id=work.group_id, prompt_id=work.problem.prompt_id,
                     prompt_token_ids=np.asarray(prompt_ids, np.int32), completions=completions,
                     policy_version=group_version(results, fallback_version), sampler_id=sampler_id, created_unix=time.time(),
                     reference_answer=work.problem.answer, data_position=work.position, injected=work.injected)
