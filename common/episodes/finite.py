"""A finite set of groups made on one serve: what evaluation, the final-weights probe, tests and benchmarks use.

The same stream, kinds and keys as a sampler's (stream.py), fed differently: the serve runs on the caller's thread,
and each of its scheduling points starts the next groups while at most `max_rows` episodes are in flight (on the
engine's own thread, so the schedule depends on nothing but the engine's own steps: the processes of a multi-process
trainer, evaluating on one global mesh, run the same programs in the same order). The stream is closed once every
group has started; the serve ends when the last has ended.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import jax

from grpo_stream.common.episodes.result import EpisodeResult, GroupWork, on_host
from grpo_stream.common.episodes.stream import RolloutStream


class _Feeding:
    """The stream as the engine sees it, starting the pending groups at its scheduling points, where it also calls
    `progress` once groups have ended since the last one."""

    def __init__(self, stream: RolloutStream, works: list[GroupWork], rollouts, max_rows: int | None, version: int,
                 progress: Callable[[], None] | None = None):
        self.stream, self.rollouts, self.max_rows, self.version = stream, rollouts, max_rows, version
        self.pending = collections.deque(works)
        self.progress, self._ended, self._reported = progress, 0, 0
        self._lock = threading.Lock()

    def group_ended(self) -> None:
        """A group ended (on whatever thread ended it: the engine's, a tool worker, a verifiers event loop)."""
        with self._lock:
            self._ended += 1

    def _feed(self) -> None:
        while self.pending and (self.max_rows is None or not self.stream.episodes_in_flight or
                                self.stream.episodes_in_flight + self.pending[0].rows <= self.max_rows):
            self.stream.start(self.pending.popleft(), self.rollouts, self.version)
        if not self.pending:
            self.stream.close()

    def take(self):
        # on the engine's thread, never on the one a group ended on: progress may pause (eval.max_share's duty
        # cycle), and paused there it held a verifiers kind's event loop (its other groups' timeouts ran on, and
        # healthy groups failed) or a tool worker, while the engine decoded on unpaused
        with self._lock:
            ended = self._ended
        if self.progress is not None and ended > self._reported:
            self._reported = ended
            self.progress()
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
    with `params` (weight `version`; `refresh` as engine.serve's); `progress` is called on the engine's thread, at
    its next scheduling point after groups ended (_Feeding.take)."""
    if not works:
        return []
    order = {id(work): i for i, work in enumerate(works)}
    done: list[list[EpisodeResult] | None] = [None] * len(works)

    def ended(run) -> None:
        done[order[id(run.work)]] = list(run.results)
        feeding.group_ended()

    stream = RolloutStream(engine.request_keys, ended)
    feeding = _Feeding(stream, works, rollouts, max_rows, version, progress)
    try:
        engine.serve(params, feeding, refresh, version)
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
