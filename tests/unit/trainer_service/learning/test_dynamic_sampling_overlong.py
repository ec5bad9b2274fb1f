"""DAPO's dynamic sampling with its overlong filter (algo.overlong=filter): a group is judged on the completions the
loss keeps, so one whose every completion was truncated is dropped, not trained as a batch slot with nothing in it."""

import numpy as np

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.trainer_service.learning.batching import build_batch, no_signal_test
from grpo_stream.trainer_service.learning.selection import select_batch

MAX_NEW = 6


def group(name, rewards, truncated):
    comps = [CompletionData(np.ones(MAX_NEW if t else 2, np.int32), np.full(MAX_NEW if t else 2, -1.0, np.float32),
                            r, t) for r, t in zip(rewards, truncated)]
    return GroupData(name, "p", np.array([1, 2], np.int32), comps, 0, "s")


def algo(*overrides):
    return load_config(None, ["algo.dynamic_sampling=true", *overrides]).algo


def test_with_the_overlong_filter_a_group_with_no_kept_completion_of_non_zero_advantage_is_dropped():
    filtering = algo("algo.overlong=filter")
    no_signal = no_signal_test(filtering, MAX_NEW)
    all_truncated = group("all-truncated", [0.1, 0.0, 0.1, 0.0], [True] * 4)  # a format reward: rewards differ
    kept_at_mean = group("kept-at-mean", [0.5, 0.5, 0.0, 1.0], [False, False, True, True])
    one_kept = group("one-kept", [1.0, 0.0, 0.0, 0.0], [False, True, True, True])
    none_truncated = group("plain", [1.0, 0.0, 0.0, 0.0], [False] * 4)
    pending = list(enumerate([all_truncated, kept_at_mean, one_kept, none_truncated]))
    batch, _, flat, _ = select_batch(pending, 4, held_version=0, max_staleness=0, no_signal=no_signal)
    assert [g.group_id for _, g in flat] == ["all-truncated", "kept-at-mean"]
    assert [g.group_id for _, g in batch] == ["one-kept", "plain"]
    # what the loss gets from the dropped ones: nothing (no kept token, or only zero advantages)
    dropped, _ = build_batch([all_truncated, kept_at_mean], 2, MAX_NEW, 0, filtering, held_version=0)
    assert not (dropped.loss_mask.sum(axis=1) * dropped.advantages).any()
    # without the filter truncated completions are trained: only equal rewards are without signal
    plain = no_signal_test(algo(), MAX_NEW)
    assert not plain(all_truncated) and not plain(kept_at_mean)
