"""The rollout stream: the request source of one long `serve` (common/engine/base.py RequestSource) that a sampler
keeps for its whole life, fed groups as capacity frees and handing each group on as soon as its last episode ends.

There is no batch: a group starts (`start`) whenever its maker decides there is room, its rows' turns enter the
engine at its next scheduling point beside whatever else is decoding, and a row's slot is free for other work the
moment its turn ends (an episode waiting for a tool holds no slot). When the last episode of a group ends, the group
goes to `on_group` (on the thread that ended it: keep it quick; the sampler scores it on its own thread); it is
in flight (`in_flight()`) until `on_group` returns, so whoever counts it there and then downstream never misses it.

Who calls what:
- the maker (the sampler's feeder, an evaluation, a benchmark): `start(work, rollouts)`, `close()` (no more groups:
  the serve ends once none is in flight), `cancel()` (give up: the serve ends at its next scheduling point),
  `set_accepting(False)` (a drain: endpoint requests from outside wait), `wait_change`;
- a rollout kind (single_turn.py, tool_turns.py, verifiers.py): `submit(request)` for each model turn, whose `tag`
  is the `TurnOwner` told when it ends (`turn_done`, on the engine's thread: quick), `release(hold_key)` for a held
  cache that will not be resumed, and `GroupRun.episode_done(row, result)`;
- the engine: the RequestSource methods.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Protocol

import numpy as np

from grpo_stream.common.engine.base import Request
from grpo_stream.common.episodes.result import EpisodeResult, GroupWork, turn_rng


class TurnOwner(Protocol):
    def turn_done(self, request: Request, tokens: np.ndarray, logprobs: np.ndarray, versions: np.ndarray | None,
                  finished: bool) -> None:
        """A model turn ended (the engine's thread: do only bookkeeping here)."""


class Rollouts(Protocol):
    """A rollout kind: how a group's episodes are made (registry.py)."""

    environment_seconds: float  # time its environments took to answer (tool calls), summed over its workers

    def start(self, run: "GroupRun") -> None:
        """Begin run.work's episodes: model turns to run.stream.submit, each episode's end to run.episode_done.
        Must not block (it runs on the maker's thread)."""

    def close(self) -> None:
        """Stop the kind's threads (episodes still running are abandoned)."""


class GroupRun:
    """One group in flight: its episodes' results as they end, and its rows' keys per turn."""

    def __init__(self, work: GroupWork, stream: "RolloutStream", version: int):
        self.work, self.stream, self.version_at_start = work, stream, version
        self.results: list[EpisodeResult | None] = [None] * work.rows
        self.started = time.monotonic()
        self._left = work.rows
        self._keys: dict[int, list] = {}
        self._lock = threading.Lock()

    def key(self, row: int, turn: int) -> Any:
        """Row `row`'s key for its turn `turn` (result.py: turn 0 is what engine.generate gives that row)."""
        with self._lock:
            keys = self._keys.get(turn)
        if keys is None:
            keys = self.stream.request_keys(turn_rng(self.work.key, turn), self.work.rows)  # on the host
            with self._lock:
                self._keys[turn] = keys
        return keys[row]

    def episode_done(self, row: int, result: EpisodeResult) -> None:
        with self._lock:
            if self.results[row] is not None:
                raise RuntimeError(f"group {self.work.group_id}: episode {row} ended twice")
            self.results[row] = result
            self._left -= 1
            done = self._left == 0
        self.stream._episode_done(self if done else None)


class RolloutStream:
    """See the module docstring. `request_keys`: the engine's (engine.request_keys); `on_group(run)`: a group ended
    (run.results all set)."""

    def __init__(self, request_keys: Callable[[Any, int], list], on_group: Callable[[GroupRun], None]):
        self.request_keys, self.on_group = request_keys, on_group
        self._cond = threading.Condition()
        self._ready: collections.deque[Request] = collections.deque()
        self._released: list = []
        self._runs: set[GroupRun] = set()
        # episodes started and not ended (waiting for the engine, decoding, or for a tool): a group whose other rows
        # ended holds room for its last one only, so a long-tailed group never keeps the engine's slots idle
        self.episodes_in_flight = 0
        self.turns_in_engine = 0      # taken by the engine, not finished
        self.groups_started = self.groups_done = 0
        self._closing = self._cancelled = False
        self._accepting = True
        self._holds = 0
        self.idle_seconds = 0.0  # the engine waited with nothing to decode (its `wait` is called only then)

    # ---- the maker's side ----------------------------------------------------------------------------------

    def start(self, work: GroupWork, rollouts: Rollouts, version: int = 0) -> GroupRun:
        """Start `work`'s episodes with `rollouts` (`version`: the weights installed now, the fallback for a group
        whose tokens record none)."""
        run = GroupRun(work, self, version)
        with self._cond:
            if self._closing or self._cancelled:
                raise RuntimeError("the rollout stream is closed: no group may start")
            self._runs.add(run)
            self.episodes_in_flight += work.rows
            self.groups_started += 1
        rollouts.start(run)
        return run

    def close(self) -> None:
        """No more groups: the serve ends once the groups in flight have."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def cancel(self) -> None:
        """Give up every group in flight: the serve ends at its next scheduling point."""
        with self._cond:
            self._closing = self._cancelled = True
            self._ready.clear()
            self._cond.notify_all()

    def set_accepting(self, accepting: bool) -> None:
        self._accepting = accepting

    def in_flight(self) -> list[GroupRun]:
        with self._cond:
            return list(self._runs)

    def wait_change(self, timeout: float) -> None:
        """Block until a group ends, the stream closes or `timeout` passes."""
        with self._cond:
            self._cond.wait(timeout)

    def wants_engine(self) -> int:
        """Turns waiting for the engine or decoding in it (episodes waiting for a tool are not counted)."""
        with self._cond:
            return len(self._ready) + self.turns_in_engine

    def room(self, rows_in_flight: int, slots: int) -> int:
        """Rows a maker may start now: fewer than `rows_in_flight` episodes in flight in all, and fewer than the
        engine's `slots` wanting it (an episode waiting for its tool holds no slot, so multi-turn episodes beyond the
        slots keep the engine full while others wait)."""
        with self._cond:
            return min(rows_in_flight - self.episodes_in_flight, slots - len(self._ready) - self.turns_in_engine)

    # ---- the rollout kinds' side ---------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """A model turn ready for the engine; `request.tag` is its TurnOwner."""
        with self._cond:
            if self._cancelled:
                return
            self._ready.append(request)
            self._cond.notify_all()

    def hold_key(self) -> int:
        """A key no other episode of this stream holds a cache under."""
        with self._cond:
            self._holds += 1
            return self._holds

    def release(self, hold_key: Any) -> None:
        with self._cond:
            self._released.append(hold_key)

    def _episode_done(self, run: GroupRun | None) -> None:
        """An episode ended; `run`: its group, when that was the group's last. The group stays in flight (in
        `in_flight()`, and the stream open) until `on_group` has it: removed first, a feeder counting the groups in
        flight and then the sink's missed it (one short in its Admit), and a closed stream's serve could end before
        its last group was handed on (run_groups: "groups unfinished")."""
        with self._cond:
            self.episodes_in_flight -= 1
            self._cond.notify_all()
            if run is None or run not in self._runs:
                return
            hand_over = not self._cancelled
        try:
            if hand_over:
                self.on_group(run)  # outside the lock: the engine's thread is not held up by it
        finally:
            with self._cond:
                self._runs.discard(run)
                self.groups_done += 1
                self._cond.notify_all()

    # ---- the engine's side (RequestSource) -----------------------------------------------------------------

    def take(self) -> list[Request]:
        with self._cond:
            taken = list(self._ready)
            self._ready.clear()
            self.turns_in_engine += len(taken)
        return taken

    def finish(self, request: Request, tokens, logprobs, versions, finished: bool) -> None:
        with self._cond:
            self.turns_in_engine -= 1
            self._cond.notify_all()  # a slot freed: a feeder waiting for room starts rows now, not at its next look
        request.tag.turn_done(request, tokens, logprobs, versions, finished)

    def open(self) -> bool:
        with self._cond:
            return not self._cancelled and not (self._closing and not self._runs)

    def accepting(self) -> bool:
        return self._accepting

    def released(self) -> list:
        with self._cond:
            ended, self._released = self._released, []
        return ended

    def cancelled(self) -> bool:
        return self._cancelled

    def wait(self, timeout: float) -> None:
        started = time.monotonic()
        with self._cond:
            if not self._ready and not self._cancelled and not (self._closing and not self._runs):
                self._cond.wait(timeout)
        self.idle_seconds += time.monotonic() - started
