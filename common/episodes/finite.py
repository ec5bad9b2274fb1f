"""A finite set of groups made on one serve: what evaluation, the final-weights probe, tests and benchmarks use.

The same stream, kinds and keys as a sampler's (stream.py): `run_groups` starts the groups (at most `max_rows`
episodes in flight), closes the stream and returns each group's episodes once the serve has ended. The serve runs on
a thread of its own while the caller feeds it and calls `progress` (a heartbeat) as groups end.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import jax

from grpo_stream.common.episodes.result import EpisodeResult, GroupWork
from grpo_stream.common.episodes.stream import RolloutStream

WAIT_S = 0.2


def run_groups(engine, params: Any, works: list[GroupWork], rollouts, max_rows: int | None = None,
               version: int = 0, refresh: Callable | None = None,
               progress: Callable[[], None] | None = None) -> list[list[EpisodeResult]]:
    """The episodes of every group of `works` (one list per group, rows in order), made by `rollouts` on `engine`
    with `params` (weight `version`; `refresh` as engine.serve's)."""
    if not works:
        return []
    order = {id(work): i for i, work in enumerate(works)}
    done: list[list[EpisodeResult] | None] = [None] * len(works)
    stream = RolloutStream(engine.request_keys,
                           on_group=lambda run: done.__setitem__(order[id(run.work)], list(run.results)))
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            engine.serve(params, stream, refresh, version)
        except BaseException as exc:  # noqa: BLE001 - raised again on the caller's thread
            failure.append(exc)
            stream.cancel()

    thread = threading.Thread(target=serve, name="rollout-serve", daemon=True)
    thread.start()
    try:
        for work in works:
            while max_rows is not None and stream.episodes_in_flight and \
                    stream.episodes_in_flight + work.rows > max_rows and not failure:
                stream.wait_change(WAIT_S)
                if progress is not None:
                    progress()
            if failure:
                break
            stream.start(work, rollouts, version)
        stream.close()
        while thread.is_alive():
            thread.join(WAIT_S)
            if progress is not None:
                progress()
    except BaseException:
        stream.cancel()
        thread.join()
        raise
    if failure:
        raise failure[0]
    missing = [works[i].group_id for i, found in enumerate(done) if found is None]
    if missing:
        raise RuntimeError(f"the serve ended with groups unfinished: {missing[:3]}")
    return done


def run_episodes(engine, params: Any, problems: list, prompts: list[list[int]], rollouts, rng, greedy: bool = False,
                 refresh: Callable | None = None, version: int = 0, rewards=None) -> list[EpisodeResult]:
    """One episode per problem (problems[i] from prompts[i], a group of one row keyed fold_in(rng, i)), all in flight
    at once: what benchmarks and tests of a rollout kind run."""
    with jax.default_device(jax.devices("cpu")[0]):
        keys = [jax.random.fold_in(rng, i) for i in range(len(problems))]
    works = [GroupWork(p, list(ids), 1, rewards, f"episode/{i}", i, key, greedy=greedy)
             for i, (p, ids, key) in enumerate(zip(problems, prompts, keys))]
    return [group[0] for group in run_groups(engine, params, works, rollouts, version=version, refresh=refresh)]
