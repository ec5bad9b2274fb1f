import numpy as np

from common.wire import CompletionData, GroupData
from trainer_service.selection import partition_groups


def g(version, rewards):
    comps = [CompletionData(np.array([1], np.int32), np.array([-1.0], np.float32), r, False) for r in rewards]
    return GroupData(f"g{version}-{rewards}", "p", np.array([1], np.int32), comps, version, "s")


def test_dynamic_sampling_removes_exactly_the_zero_variance_groups():
    pending = [(i, grp) for i, grp in enumerate([g(5, [1, 0]), g(5, [1, 1]), g(4, [0, 0]), g(5, [0.5, 0.25]),
                                                 g(1, [1, 0]), g(1, [1, 1])])]
    usable, stale, flat = partition_groups(pending, held_version=5, max_staleness=2, dynamic_sampling=True)
    assert [k for k, _ in usable] == [0, 3]
    assert [k for k, _ in flat] == [1, 2]
    assert [k for k, _ in stale] == [4, 5]  # staleness is checked first
    usable, stale, flat = partition_groups(pending, 5, 2, dynamic_sampling=False)
    assert [k for k, _ in usable] == [0, 1, 2, 3] and flat == []


def test_staleness_bound_is_inclusive():
    usable, stale, _ = partition_groups([(0, g(3, [1, 0])), (1, g(2, [1, 0]))], 5, 2, False)
    assert [k for k, _ in usable] == [0] and [k for k, _ in stale] == [1]
