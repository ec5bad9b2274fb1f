import itertools

import numpy as np
import pytest

from grpo_stream.common.engine.base import Generation
from grpo_stream.common.tasks.rewards import DEFAULT_WEIGHTS, RewardSet
from grpo_stream.common.tasks.arith import ArithTask
from grpo_stream.sampler_service.grouping import build_groups


def test_groups_are_scored_and_sliced_per_prompt(tiny_parts):
    _, _, tok, _ = tiny_parts
    task = ArithTask(10, 99, 0.1, seed=0)
    problems = [task.train_problem(0), task.train_problem(1)]
    batch = [(p, tok.encode(p.prompt)) for p in problems]
    texts = [f" x #### {problems[0].answer}", " x #### 0", f" #### {problems[1].answer}", " nothing"]
    rows = [tok.encode(t) + [tok.eos_id] for t in texts]
    rows[3] = rows[3][:-1]  # the last one hit the length limit without EOS
    width = max(map(len, rows)) + 2
    tokens = np.full((4, width), tok.pad_id, np.int32)
    logprobs = np.zeros((4, width), np.float32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
        logprobs[i, :len(r)] = -0.5
    out = Generation(tokens, logprobs, np.array([len(r) for r in rows]), np.array([True, True, True, False]))
    ids = itertools.count()
    groups = list(build_groups(batch, out, 2, tok, RewardSet(DEFAULT_WEIGHTS), policy_version=7, sampler_id="sampler-1",
                               group_ids=[f"run/sampler-1/{next(ids)}" for _ in batch], positions=[5, 6]))
    assert [g.group_id for g in groups] == ["run/sampler-1/0", "run/sampler-1/1"]
    assert [g.data_position for g in groups] == [5, 6]
    assert [g.prompt_id for g in groups] == [p.prompt_id for p in problems]
    assert all(g.policy_version == 7 and g.sampler_id == "sampler-1" for g in groups)
    assert [c.reward_components["answer_correct"] for g in groups for c in g.completions] == [1.0, 0.0, 1.0, 0.0]
    assert [c.truncated for g in groups for c in g.completions] == [False, False, False, True]
    for g, r in zip([c for g in groups for c in g.completions], rows):
        assert g.token_ids.tolist() == r and len(g.logprobs) == len(r)
    assert groups[0].reference_answer == problems[0].answer


def test_row_count_must_match(tiny_parts):
    _, task, tok, _ = tiny_parts
    out = Generation(np.zeros((3, 4), np.int32), np.zeros((3, 4), np.float32), np.ones(3, int), np.ones(3, bool))
    with pytest.raises(ValueError, match="3 completions for 1 prompts x 2"):
        list(build_groups([(task.train_problem(0), [1])], out, 2, tok, RewardSet(DEFAULT_WEIGHTS), 0, "s", ["g"]))


def test_a_group_of_mixed_versions_counts_as_its_oldest_token(tiny_parts):
    """sampler.weight_updates=in_flight: per-token versions go with each completion, and the group's
    policy_version (what staleness is judged by) is the oldest of them."""
    _, _, tok, _ = tiny_parts
    task = ArithTask(10, 99, 0.1, seed=0)
    problems = [task.train_problem(0), task.train_problem(1)]
    batch = [(p, tok.encode(p.prompt)) for p in problems]
    tokens = np.full((4, 4), 5, np.int32)
    versions = np.array([[8, 8, 9, 9], [8, 9, 9, 9], [9, 9, 9, 10], [9, 10, -1, -1]], np.int32)
    out = Generation(tokens, -np.ones((4, 4), np.float32), np.array([4, 4, 4, 2]), np.zeros(4, bool),
                     versions=versions)
    groups = list(build_groups(batch, out, 2, tok, RewardSet(DEFAULT_WEIGHTS), policy_version=10,
                               sampler_id="sampler-0", group_ids=["a", "b"]))
    assert [g.policy_version for g in groups] == [8, 9]
    assert groups[1].completions[1].versions.tolist() == [9, 10]
