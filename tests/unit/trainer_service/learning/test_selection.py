import numpy as np

from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.learning.batching import no_signal_test
from grpo_stream.trainer_service.learning.selection import select_batch

FLAT = no_signal_test(load_config(None, ["algo.dynamic_sampling=true"]).algo, max_new=16)


def g(version, rewards):
    comps = [CompletionData(np.array([1], np.int32), np.array([-1.0], np.float32), r, False) for r in rewards]
    return GroupData(f"g{version}-{rewards}", "p", np.array([1], np.int32), comps, version, "s")


def keys(pairs):
    return [k for k, _ in pairs]


def test_dynamic_sampling_removes_exactly_the_zero_variance_groups():
    pending = list(enumerate([g(5, [1, 0]), g(5, [1, 1]), g(4, [0, 0]), g(5, [0.5, 0.25]), g(1, [1, 0]),
                              g(1, [1, 1])]))
    batch, stale, flat, rest = select_batch(pending, 10, held_version=5, max_staleness=2, no_signal=FLAT)
    assert keys(batch) == [0, 3] and keys(flat) == [1, 2] and rest == []
    assert keys(stale) == [4, 5]  # staleness is checked first
    batch, stale, flat, rest = select_batch(pending, 10, 5, 2, no_signal=None)
    assert keys(batch) == [0, 1, 2, 3] and flat == []


def test_staleness_bound_is_inclusive_and_versions_ahead_are_stale():
    batch, stale, _, _ = select_batch(list(enumerate([g(3, [1, 0]), g(2, [1, 0]), g(6, [1, 0])])), 5, 5, 2, None)
    assert keys(batch) == [0] and keys(stale) == [1, 2]


def test_only_groups_up_to_the_batch_are_judged():
    """A stale group after the batch is left for later (a read-ahead must not change what a step drops)."""
    pending = list(enumerate([g(1, [1, 0]), g(5, [1, 0]), g(5, [0, 1]), g(1, [1, 0]), g(5, [1, 0])]))
    batch, stale, flat, rest = select_batch(pending, 2, 5, 2, None)
    assert keys(batch) == [1, 2] and keys(stale) == [0] and keys(rest) == [3, 4]
    # the same groups read one at a time give the same batches
    got, held = [], []
    for item in pending:
        held.append(item)
        batch, _, _, held = select_batch(held, 2, 5, 2, None)
        if len(batch) == 2:
            got.append(keys(batch))
        else:
            held = batch + held
    assert got == [[1, 2]]


def test_with_the_overlong_penalty_equal_rewards_of_different_lengths_are_a_signal():
    """DAPO's two features together: four correct answers, two inside the penalty's ramp, have different training
    rewards (so non-zero advantages): kept. Equal lengths stay flat."""
    algo = load_config(None, ["algo.dynamic_sampling=true", "algo.overlong=penalty",
                              "algo.overlong_buffer_tokens=8"]).algo
    no_signal = no_signal_test(algo, max_new=16)

    def sized(lengths):
        comps = [CompletionData(np.ones(n, np.int32), np.full(n, -1.0, np.float32), 1.0, False) for n in lengths]
        return GroupData(f"g{lengths}", "p", np.array([1], np.int32), comps, 5, "s")

    assert not no_signal(sized([16, 10, 10, 15])) and FLAT(sized([16, 10, 10, 15]))
    assert no_signal(sized([4, 6, 8, 5]))  # all before the ramp: the same reward, no signal
    assert no_signal_test(load_config(None, []).algo, 16) is None  # dynamic sampling off


def test_the_step_report_counts_groups_without_signal_as_dynamic_sampling_judges_them():
    from grpo_stream.trainer_service.reports.step_report import StepReporter

    reporter = StepReporter.__new__(StepReporter)  # its counting alone
    reporter.cfg = load_config(None, ["generation.max_new_tokens=16", "algo.overlong=penalty",
                                      "algo.overlong_buffer_tokens=8"])

    def sized(lengths):
        comps = [CompletionData(np.ones(n, np.int32), np.full(n, -1.0, np.float32), 1.0, False) for n in lengths]
        return GroupData(f"g{lengths}", "p", np.array([1], np.int32), comps, 5, "s")

    assert reporter._without_signal([sized([16, 10, 10, 15]), sized([4, 6, 8, 5])]) == 1
