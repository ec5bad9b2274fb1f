"""Which buffered groups a trainer step uses (pure, so it is tested on its own)."""

from __future__ import annotations

from typing import Callable, TypeVar

from grpo_stream.common.rollouts.wire import GroupData

T = TypeVar("T")


def select_batch(pending: list[tuple[T, GroupData]], need: int, held_version: int, max_staleness: int,
                 no_signal: Callable[[GroupData], bool] | None) -> tuple[list, list, list, list]:
    """Walk (key, group) pairs in order until `need` usable ones are found: (batch, stale, zero_variance, rest).

    Only groups up to the last one taken are judged; `rest` keeps the others, in order, for later steps.
    So which groups a step trains on depends only on their order and the step, not on how many the
    trainer happened to have read: a resumed trainer fed the same stream builds the same batches.
    `batch` is complete only if len(batch) == need (then nothing is left unjudged before `rest`).

    stale:         held_version - policy_version > max_staleness (never trained on), or a version
                   ahead of the trainer's (made with weights of an earlier trainer process that got
                   further before it was restarted; their importance correction would be meaningless)
    zero_variance: `no_signal` says so (algo.dynamic_sampling: every completion's training reward is the
                   same, so their advantages are all zero: no signal, only dilution; None: off)
    """
    batch, stale, flat = [], [], []
    for i, (key, group) in enumerate(pending):
        if len(batch) == need:
            return batch, stale, flat, pending[i:]
        if not 0 <= held_version - group.policy_version <= max_staleness:
            stale.append((key, group))
        elif no_signal is not None and no_signal(group):
            flat.append((key, group))
        else:
            batch.append((key, group))
    return batch, stale, flat, []
