import numpy as np

from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.trainer_service.learning.batching import build_batch, layout


def group(prompt, completions, rewards):
    return GroupData("g", "p", np.array(prompt, np.int32),
                     [CompletionData(np.array(c, np.int32), -np.arange(1, len(c) + 1, dtype=np.float32) / 10, r,
                                     False) for c, r in zip(completions, rewards)], 0, "s")


def test_layout_left_pads_prompt_and_right_pads_completion():
    tokens, valid = layout(np.array([7, 8]), np.array([9, 10, 11]), 4, 5, pad_id=0)
    assert tokens.tolist() == [0, 0, 7, 8, 9, 10, 11, 0, 0]
    assert valid.tolist() == [False, False, True, True, True, True, True, False, False]


def test_targets_and_behaviour_logprobs_are_aligned():
    g = group([5, 6, 7], [[20, 21], [22, 23, 24]], [1.0, 0.0])
    batch, stats = build_batch([g], max_prompt=4, max_new=4, pad_id=0, algo=AlgoSection(), held_version=0)
    tokens = np.asarray(batch.tokens)
    mask = np.asarray(batch.loss_mask)
    beh = np.asarray(batch.behaviour_logprobs)
    # the targets under the mask are exactly the completion tokens, in order
    assert tokens[0, 1:][mask[0] > 0].tolist() == [20, 21]
    assert tokens[1, 1:][mask[1] > 0].tolist() == [22, 23, 24]
    np.testing.assert_allclose(beh[1][mask[1] > 0], [-0.1, -0.2, -0.3], rtol=1e-6)
    assert np.asarray(batch.advantages)[0] > 0 > np.asarray(batch.advantages)[1]
    assert stats["reward_mean"] == 0.5 and stats["response_length_mean"] == 2.5
    assert stats["model_token_fraction"] == 1.0  # single-turn: every token is the model's
    # 3 + 2 and 3 + 3 real tokens of 2 x 8 laid out: the padding the update computes over
    assert stats["real_tokens"] == 11 and stats["padding_fraction"] == 1 - 11 / 16


def test_observation_tokens_stay_in_the_sequence_without_loss():
    """A multi-turn completion: model turn [20, 21], observation [30, 31, 32] (logprob 0), model turn [22]. Every
    token is laid out (the model reads the observation); only the model's are in the loss."""
    multi = CompletionData(np.array([20, 21, 30, 31, 32, 22], np.int32),
                           np.array([-0.1, -0.2, 0.0, 0.0, 0.0, -0.3], np.float32), 1.0, False,
                           model_mask=np.array([1, 1, 0, 0, 0, 1], np.bool_))
    single = CompletionData(np.array([23, 24], np.int32), np.array([-0.4, -0.5], np.float32), 0.0, False)
    g = GroupData("g", "p", np.array([5, 6], np.int32), [multi, single], 0, "s")
    batch, stats = build_batch([g], max_prompt=3, max_new=6, pad_id=0, algo=AlgoSection(), held_version=0)
    tokens, mask = np.asarray(batch.tokens), np.asarray(batch.loss_mask)
    beh = np.asarray(batch.behaviour_logprobs)
    assert tokens[0].tolist() == [0, 5, 6, 20, 21, 30, 31, 32, 22] and np.asarray(batch.valid)[0].sum() == 8
    assert mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0, 1]  # targets 20, 21, 30, 31, 32, 22 at positions 2..7
    assert tokens[0, 1:][mask[0] > 0].tolist() == [20, 21, 22]
    np.testing.assert_allclose(beh[0], [0, 0, -0.1, -0.2, 0, 0, 0, -0.3], rtol=1e-6)
    assert tokens[1, 1:][mask[1] > 0].tolist() == [23, 24]
    # the response length is the whole completion's; 5 of its 8 tokens are the model's
    assert stats["response_length_mean"] == 4.0 and stats["model_token_fraction"] == 5 / 8
    # the overlong filter still masks a whole truncated completion, observation tokens or not
    multi.truncated = True
    batch, _ = build_batch([g], 3, 6, 0, AlgoSection(overlong="filter", overlong_buffer_tokens=1), held_version=0)
    assert np.asarray(batch.loss_mask).sum(axis=1).tolist() == [0.0, 2.0]


def test_fresh_marks_groups_made_with_the_held_version():
    g0 = group([5], [[20], [21]], [1.0, 0.0])
    g1 = group([5], [[20], [21]], [1.0, 0.0])
    g1.policy_version = 3
    batch, _ = build_batch([g0, g1], 2, 2, 0, AlgoSection(), held_version=3)
    assert np.asarray(batch.fresh).tolist() == [0, 0, 1, 1]


def test_overlong_filter_masks_truncated_completions_only():
    g = group([5], [[20, 21], [22, 23]], [1.0, 0.0])
    g.completions[1].truncated = True
    batch, stats = build_batch([g], 2, 2, 0, AlgoSection(overlong="filter", overlong_buffer_tokens=1),
                               held_version=0)
    assert np.asarray(batch.loss_mask).sum(axis=1).tolist() == [2.0, 0.0]
    assert stats["truncated_fraction"] == 0.5


def test_overlong_penalty_lowers_the_reward_near_the_limit():
    # DAPO soft punishment, max_new 4, buffer 2: length 3 -> half penalty, length 4 -> full, length 1 -> none
    g = group([5], [[20, 21, 22], [22, 23, 24, 25], [1]], [1.0, 1.0, 1.0])
    algo = AlgoSection(overlong="penalty", overlong_buffer_tokens=2, overlong_penalty=1.0,
                       advantage_estimator="drgrpo")
    batch, stats = build_batch([g], 2, 4, 0, algo, held_version=0)
    rewards = np.array([0.5, 0.0, 1.0])
    np.testing.assert_allclose(np.asarray(batch.advantages), rewards - rewards.mean(), atol=1e-6)
