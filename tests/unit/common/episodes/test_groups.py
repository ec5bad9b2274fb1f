"""The one group builder: every kind's episodes become a group the same way. Episodes are scored by the group's
rewards on what the model wrote (or keep a rubric's reward), cut ones are truncated, an episode's observations keep
their mask, a group counts as its oldest token's version, and the group carries its id, position and prompt."""

import types

import numpy as np
import pytest

from grpo_stream.common.episodes.groups import TURN_REWARD, build_group, score_episode
from grpo_stream.common.episodes.result import EpisodeResult, GroupWork
from grpo_stream.common.rollouts.wire import from_proto, to_proto
from grpo_stream.common.tasks.arith import ArithTask
from grpo_stream.common.tasks.rewards import DEFAULT_WEIGHTS, RewardSet


def single_turn(tok, text: str, finished: bool, version: int) -> EpisodeResult:
    ids = tok.encode(text) + ([tok.eos_id] if finished else [])
    result = EpisodeResult()
    result.add_turn(ids, [-0.5] * len(ids), [version] * len(ids), finished)
    result.finished = finished
    return result


def work(problem, tok, rows: int, position: int | None = 5) -> GroupWork:
    return GroupWork(problem, tok.encode(problem.prompt), rows, RewardSet(DEFAULT_WEIGHTS), "run/sampler-1/5",
                     position, None)


def test_single_turn_episodes_are_scored_on_their_text_and_cut_ones_are_truncated(tiny_parts):
    _, _, tok, _ = tiny_parts
    problem = ArithTask(10, 99, 0.1, seed=0).train_problem(0)
    results = [single_turn(tok, f" x #### {problem.answer}", True, 7), single_turn(tok, " nothing", False, 7)]
    group = build_group(work(problem, tok, 2), results, "sampler-1", tok)
    assert (group.group_id, group.data_position, group.prompt_id, group.sampler_id) == (
        "run/sampler-1/5", 5, problem.prompt_id, "sampler-1")
    assert group.policy_version == 7 and not group.injected and group.reference_answer == problem.answer
    assert [c.reward_components["answer_correct"] for c in group.completions] == [1.0, 0.0]
    assert [c.truncated for c in group.completions] == [False, True]
    assert group.completions[0].token_ids.tolist() == results[0].tokens
    assert group.prompt_token_ids.tolist() == tok.encode(problem.prompt)
    wire = to_proto(group)
    assert not any(c.version_runs for c in wire.completions)  # one version throughout: said once, by the group
    assert not any(c.model_token_mask for c in wire.completions)


def test_a_group_of_mixed_versions_counts_as_its_oldest_token(tiny_parts):
    """In-flight weight updates: each completion carries its per-token versions, and the group's policy_version
    (what staleness is judged by) is the oldest of them."""
    _, _, tok, _ = tiny_parts
    problem = ArithTask(10, 99, 0.1, seed=0).train_problem(1)
    a, b = EpisodeResult(), EpisodeResult()
    a.add_turn([5, 5, 5, 5], [-1.0] * 4, [9, 9, 9, 10], False)
    b.add_turn([5, 5], [-1.0] * 2, [9, 10], False)
    group = build_group(work(problem, tok, 2), [a, b], "sampler-0", tok, fallback_version=12)
    assert group.policy_version == 9
    assert from_proto(to_proto(group)).completions[1].versions.tolist() == [9, 10]


def test_observations_keep_their_mask_and_turn_rewards_are_weighted(tiny_parts):
    _, _, tok, _ = tiny_parts
    problem = ArithTask(10, 99, 0.1, seed=0).train_problem(2)
    result = EpisodeResult()
    result.add_turn([11, 12], [-0.2, -0.3], [4, 4], True)
    result.turn_texts.append("call")
    result.add_observation([40, 41, 42])
    result.add_turn([13], [-0.4], [5], True)
    result.turn_texts.append(f"#### {problem.answer}")
    result.turn_rewards += [0.5, 0.25]
    result.finished = True
    group = build_group(work(problem, tok, 1), [result], "sampler-0", tok, turn_weight=2.0)
    c = group.completions[0]
    assert c.model_mask.tolist() == [True, True, False, False, False, True]
    assert c.logprobs.tolist() == pytest.approx([-0.2, -0.3, 0, 0, 0, -0.4])
    assert c.versions.tolist() == [4, 4, 4, 4, 4, 5] and group.policy_version == 4
    assert c.reward_components[TURN_REWARD] == 1.5 and c.reward_components["answer_correct"] == 1.0


def test_a_kind_that_scores_its_episodes_keeps_its_reward_and_prompt(tiny_parts):
    _, _, tok, _ = tiny_parts
    problem = ArithTask(10, 99, 0.1, seed=0).train_problem(3)
    scored = [EpisodeResult(reward=0.75, reward_components={"rubric": 0.75}, prompt_ids=[1, 2, 3], finished=True)
              for _ in range(2)]
    for r in scored:
        r.add_turn([7], [-0.1], [3], True)
    group = build_group(work(problem, tok, 2, position=None), scored, "sampler-0", tok)
    assert group.rewards.tolist() == [0.75, 0.75] and group.completions[0].reward_components == {"rubric": 0.75}
    assert group.prompt_token_ids.tolist() == [1, 2, 3] and group.injected and group.data_position is None
    scored[1].prompt_ids = [1, 2]
    with pytest.raises(ValueError, match="different prompt ids"):
        build_group(work(problem, tok, 2), scored, "sampler-0", tok)


def test_every_row_needs_its_episode(tiny_parts):
    _, _, tok, _ = tiny_parts
    problem = ArithTask(10, 99, 0.1, seed=0).train_problem(0)
    with pytest.raises(ValueError, match="1 episodes for 2 rows"):
        build_group(work(problem, tok, 2), [EpisodeResult()], "s", tok)
    assert np.asarray(work(problem, tok, 2).prompt_ids).ndim == 1


@pytest.mark.parametrize("turns", [
    [" #### 75 <call>add(37, 48)</call>", " #### 85"],  # a guess before the tool answered
    ['<tool_call>\n{"name": "python", "arguments": {"code": "print(\'#### 75\')"}}\n</tool_call>',
     "The tool says 85.\n#### 85"],  # tool code that prints an answer
], ids=["guess-then-call", "code-prints-an-answer"])
def test_a_tool_episode_is_scored_by_its_final_turn(turns):
    """The first stated answer wins within a text (answers.py): scored on all turns joined, a guess or a tool call's
    code in an earlier turn outranked the corrected final answer. Rewards read the final turn only."""
    problem = types.SimpleNamespace(prompt_id="p", prompt="q", answer="85")
    work = GroupWork(problem, [1], 1, RewardSet(DEFAULT_WEIGHTS), "g", 0, None)
    result = EpisodeResult(turn_texts=list(turns))
    reward, parts = score_episode(result, work, None, 0.0)
    assert parts == {"answer_correct": 1.0, "answer_format": 1.0} and reward == pytest.approx(1.1)
    result.turn_texts = [" #### 85 <call>add(37, 48)</call>", " = 85, so it is 75"]  # wrong at the end: wrong
    assert score_episode(result, work, None, 0.0)[1]["answer_correct"] == 0.0
