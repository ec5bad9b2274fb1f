"""Each sampler's endless stream of a task's training problems: its shard, reshuffled every pass, resumable."""

from __future__ import annotations

import random
from typing import Iterator, Sequence, TypeVar

T = TypeVar("T")


def shuffled_shard(items: Sequence[T], index: int, count: int, seed: int, start: int, what: str) -> Iterator[T]:
    """Sampler `index` of `count`: every count-th item from `index` on, reshuffled every pass (seeded by `seed` and
    the index), from stream position `start` on (a restarted sampler resumes where its accepted groups end, in the
    order an uninterrupted one would have). `what` names the data in the error for an empty shard."""
    mine = list(items[index::count])
    if not mine:
        raise ValueError(f"{what}: sampler {index} of sampler.replicas={count} has no training problems (there are "
                         f"{len(items)})")
    rng = random.Random(seed * 1_000_003 + index)
    passes, skip = divmod(start, len(mine))
    while True:
        order = list(range(len(mine)))
        rng.shuffle(order)
        if passes:  # the shuffles of passes already done, to keep the order an uninterrupted sampler has
            passes -= 1
            continue
        for i in order[skip:]:
            yield mine[i]
        skip = 0
