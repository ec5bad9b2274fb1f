"""A verifiers rollout's per-turn token records -> one completion: the model's ids with their logprobs, the ids the
environment's messages added between turns as observation tokens (not trained on), truncation at the episode
budget, and refusal of what cannot be one token sequence (logic only: the real package and endpoint run in
tests/e2e/test_verifiers_run.py)."""

import numpy as np
import pytest

from grpo_stream.sampler_service.verifiers_groups import RolloutError, completion_of


def turn(prompt, completion, logprobs=None):
    return {"tokens": {"prompt_ids": prompt, "completion_ids": completion,
                       "completion_logprobs": logprobs or [-0.5] * len(completion)}}


def test_turns_become_model_tokens_with_observations_between_them():
    out = {"trajectory": [turn([1, 2, 3], [10, 11], [-0.1, -0.2]),
                          turn([1, 2, 3, 10, 11, 50, 51], [12], [-0.3])],
           "reward": 1.25, "metrics": {"correct_answer": 1.0, "brevity": 1.0, "label": "x"}}
    prompt, c = completion_of(out, max_tokens=64)
    assert prompt == [1, 2, 3]
    assert c.token_ids.tolist() == [10, 11, 50, 51, 12]
    assert c.model_mask.tolist() == [True, True, False, False, True]
    assert np.allclose(c.logprobs, [-0.1, -0.2, 0.0, 0.0, -0.3])
    assert c.reward == 1.25 and c.reward_components == {"correct_answer": 1.0, "brevity": 1.0}
    assert not c.truncated


def test_an_episode_over_the_budget_is_cut_and_marked_truncated():
    out = {"trajectory": [turn([1], [5, 6, 7, 8])], "reward": 0.0, "is_truncated": False}
    _, c = completion_of(out, max_tokens=3)
    assert c.token_ids.tolist() == [5, 6, 7] and c.truncated


@pytest.mark.parametrize("out, why", [
    ({"trajectory": [turn([1, 2], [3]), turn([1, 9, 3, 4], [5])]}, "does not continue"),
    ({"trajectory": [{"tokens": None}]}, "no token ids"),
    ({"trajectory": []}, "no model call"),
    ({"trajectory": [turn([1], [2])], "error": "ModelError: refused"}, "ModelError"),
])
def test_what_is_not_one_token_sequence_is_refused(out, why):
    with pytest.raises(RolloutError, match=why):
        completion_of(out, max_tokens=64)


@pytest.mark.parametrize("overrides, message", [
    (["task.name=verifiers"], "task.verifiers.environment"),
    (["task.name=verifiers", "task.verifiers.environment=x", "trainer.eval_before=true"], "trainer.eval_before"),
])
def test_a_verifiers_run_is_configured_completely(overrides, message):
    from grpo_stream.common.config.loading import load_config
    from grpo_stream.common.config.schema import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
