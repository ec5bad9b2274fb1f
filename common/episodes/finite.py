"""A finite set of groups made on one serve: what evaluation, the final-weights probe, tests and benchmarks use.

The same stream, kinds and keys as a sampler's (stream.py), fed differently: the serve runs on the caller's thread,
and each of its scheduling points starts the next groups while at most `max_rows` episodes are in flight (on the
engine's own thread, so the schedule depends on nothing but the engine's own steps: the processes of a multi-process
trainer, evaluating on one global mesh, run the same programs in the same order). The stream is closed once every
group has started; the serve ends when the last has ended.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import jax

from grpo_stream.common.episodes.result import EpisodeResult, GroupWork, on_host
from grpo_stream.common.episodes.stream import RolloutStream


class _Feeding:
    """The stream as the engine sees it, starting the pending groups at its scheduling points."""

    def __init__(self, stream: RolloutStream, works: list[GroupWork], rollouts, max_rows: int | None, version: int):
        self.stream, self.rollouts, self.max_rows, self.version = stream, rollouts, max_rows, version
        self.pending = collections.deque(works)

    def _feed(self) -> None:
        while self.pending and (self.max_rows is None or not self.stream.episodes_in_flight or
                                self.stream.episodes_in_flight + self.pending[0].rows <= self.max_rows):
            self.stream.start(self.pending.popleft(), self.rollouts, self.version)
        if not self.pending:
            self.stream.close()

    def take(self):
        self._feed()
        return self.stream.take()

    def finish(self, *args) -> None:
        self.stream.finish(*args)

    def open(self) -> bool:
        return bool(self.pending) or self.stream.open()

    def accepting(self) -> bool:
        return self.stream.accepting()

    def released(self) -> list:
        return self.stream.released()

    def cancelled(self) -> bool:
        return self.stream.cancelled()

    def wait(self, timeout: float) -> None:
        self.stream.wait(timeout)


def run_groups(engine, params: Any, works: list[GroupWork], rollouts, max_rows: int | None = None,
               version: int = 0, refresh: Callable | None = None,
               progress: Callable[[], None] | None = None) -> list[list[EpisodeResult]]:
    """The episodes of every group of `works` (one list per group, rows in order), made by `rollouts` on `engine`
    with `params` (weight `version`; `refresh` as engine.serve's); `progress` is called as each group ends."""
    if not works:
        return []
    order = {id(work): i for i, work in enumerate(works)}
    done: list[list[EpisodeResult] | None] = [None] * len(works)

    def ended(run) -> None:
        done[order[id(run.work)]] = list(run.results)
        if progress is not None:
            progress()

    stream = RolloutStream(engine.request_keys, ended)
    try:
        engine.serve(params, _Feeding(stream, works, rollouts, max_rows, version), refresh, version)
    except BaseException:
        stream.cancel()
        raise
    missing = [works[i].group_id for i, found in enumerate(done) if found is None]
    if missing:
        raise RuntimeError(f"the serve ended with groups unfinished: {missing[:3]}")
    return done


def run_episodes(engine, params: Any, problems: list, prompts: list[list[int]], rollouts, rng, greedy: bool = False,
                 refresh: Callable | None = None, version: int = 0, rewards=None) -> list[EpisodeResult]:
    """One episode per problem (problems[i] from prompts[i], a group of one row keyed fold_in(rng, i)), all in flight
    at once: what benchmarks and tests of a rollout kind run."""
    keys = [jax.random.fold_in(on_host(rng), i) for i in range(len(problems))]
    works = [GroupWork(p, list(ids), 1, rewards, f"episode/{i}", i, key, greedy=greedy)
             for i, (p, ids, key) in enumerate(zip(problems, prompts, keys))]
    return [group[0] for group in run_groups(engine, params, works, rollouts, version=version, refresh=refresh)]
