"""Which buffered groups a trainer step may use (pure, so it is tested on its own)."""

from __future__ import annotations

from typing import TypeVar

import numpy as np

from common.wire import GroupData

T = TypeVar("T")


def partition_groups(pending: list[tuple[T, GroupData]], held_version: int, max_staleness: int,
                     dynamic_sampling: bool) -> tuple[list, list, list]:
    """Split (key, group) pairs into (usable, stale, zero_variance), keeping order.

    stale:         held_version - policy_version > max_staleness (never trained on), or a version
                   ahead of the trainer's (made with weights of an earlier trainer process
                   that got further; their importance correction would be meaningless)
    zero_variance: every completion got the same reward, when dynamic_sampling is on
                   (their advantages are all zero: no signal, only dilution)
    """
    usable, stale, flat = [], [], []
    for key, group in pending:
        if not 0 <= held_version - group.policy_version <= max_staleness:
            stale.append((key, group))
        elif dynamic_sampling and np.ptp(group.rewards) == 0:
            flat.append((key, group))
        else:
            usable.append((key, group))
    return usable, stale, flat
