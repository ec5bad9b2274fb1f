"""Where a trainer step's groups come from: the rollout buffer, read in stream order, with stale and zero-variance
groups dropped (and settled as such) on the way. Works on any `RolloutBuffer` (Redis, or in memory in tests)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from grpo_stream.common.runtime.console import detail_logger
from grpo_stream.common.rollouts.buffer import BufferEntry, BufferUnavailable, RolloutBuffer
from grpo_stream.common.rollouts.wire import GroupData, GroupLimits, decode_trainable_group
from grpo_stream.trainer_service.learning.selection import select_batch
from grpo_stream.common.runtime.backoff import Backoff, StopRequested, wait

log = logging.getLogger(__name__)
detail = detail_logger(__name__)
T = TypeVar("T")
NOTE_EVERY_S = 10.0  # how often a step that waits for groups says so
# no group read for this long: the note warns, naming what to check (a slow sampler's batch can take a minute)
QUIET_WARN_S = 120.0
# zero-variance groups in a row (in steps' worth of groups) before the trainer warns that dynamic sampling drops all
FLAT_WARN_STEPS = 10


def when_available(what: str, fn: Callable[[], T], stop: threading.Event | None = None) -> T:
    """fn() once the buffer answers: while its store is down (restarting, failing over) wait with back-off, logging.
    When the process is asked to stop (`stop` set) while the store is down, StopRequested at once instead: a stop
    must not wait for Redis (which `up` does not restart while it stops the run); what was not written is redone
    when the trainer resumes (its checkpoint lists the groups it has not acknowledged)."""
    backoff = Backoff(0.5, 10.0)
    while True:
        try:
            return fn()
        except BufferUnavailable as exc:
            if stop is not None and stop.is_set():
                raise StopRequested(f"{what}: Redis unavailable ({exc}) while stopping; not retried") from None
            delay = backoff.next()
            log.error("%s: Redis unavailable (%s); retrying in %.1fs", what, exc, delay)
            wait(delay, stop)


class GroupCollector:
    """Reads the buffer until a step has `groups_per_step` usable groups; keeps the rest for later steps."""

    def __init__(self, buffer: RolloutBuffer, groups_per_step: int, max_staleness: int,
                 no_signal: Callable[[GroupData], bool] | None,
                 stop_event: threading.Event, held: Callable[[], int], *, limits: GroupLimits,
                 waiting: Callable[[], None] | None = None, samplers: Callable[[], str] | None = None):
        """`no_signal`: algo.dynamic_sampling's test of a group (batching.no_signal_test; None: off). `limits`: what
        a group this trainer can train looks like (its generation section and vocabulary); others are settled as
        dropped_invalid. `waiting`: called every 10 s while a step waits for groups (a heartbeat: waiting for
        samplers is not hanging). `samplers`: a line on the samplers' last contact, for the waiting note (what to
        check when no group comes)."""
        self.waiting, self.limits, self.samplers = waiting, limits, samplers
        self.buffer, self.need, self.max_staleness = buffer, groups_per_step, max_staleness
        self.no_signal, self.stop_event, self.held = no_signal, stop_event, held
        self.pending: list[tuple[BufferEntry, GroupData]] = []
        # zero-variance groups dropped since a group was last usable, run-long: every group without signal means no
        # step, ever (the weights do not change, so neither do the samplers' rewards), which must be said, not spun
        self.flat_streak, self.flat_warn_at = 0, FLAT_WARN_STEPS * groups_per_step

    def collect(self, step: int, cancel: threading.Event | None = None) -> list[tuple[BufferEntry, GroupData]] | None:
        """The step's groups in stream order; None when stopping (the stop event, or `cancel`: a prefetch no longer
        wanted). Groups passed over as stale (for the version the trainer holds while it trains `step`, step - 1)
        or without reward variance are settled as dropped."""
        try:
            return self._collect(step, cancel)
        except StopRequested as exc:
            # asked to stop while Redis is away (a settle or the depth read gave up, when_available): stopping, as
            # when the read fails; raised, it failed the run before the finish plan's checkpoint of the steps done.
            # What was not settled stays in the buffer (and in `pending`), judged again by the resumed trainer
            log.warning("step %d's groups not collected: %s", step, exc)
            return None

    def _collect(self, step: int, cancel: threading.Event | None) -> list[tuple[BufferEntry, GroupData]] | None:
        need, holding = self.need, self.max_staleness
        since = last_note = time.time()
        dropped = {"stale": 0, "zero-variance": 0, "invalid": 0}  # while this step waits: the note says them
        carried, last_arrival = 0, since  # usable groups judged before this pass; when a group was last read
        while True:
            batch, stale, flat, rest = select_batch(self.pending, need, step - 1, holding, self.no_signal)
            if stale or flat:
                when_available("settling dropped groups", lambda: self.buffer.settle(
                    [(e.entry_id, e.group_id, "dropped_stale", step) for e, _ in stale]
                    + [(e.entry_id, e.group_id, "dropped_filtered", step) for e, _ in flat]), self.stop_event)
            if stale:
                detail.info("dropped %d stale groups (versions %s, trainer at %d, max_staleness %d)", len(stale),
                            sorted({g.policy_version for _, g in stale}), step - 1, holding)
            dropped["stale"] += len(stale)
            dropped["zero-variance"] += len(flat)
            self._count_flat(len(flat), len(batch) > carried)
            if len(batch) == need:
                self.pending = rest
                return batch
            self.pending, carried = batch, len(batch)  # usable groups only: every group read was judged
            if time.time() - last_note > NOTE_EVERY_S:
                self._note(step, dropped, time.time() - since, time.time() - last_arrival)
                last_note = time.time()
            if self.stop_event.is_set() or (cancel is not None and cancel.is_set()):
                return None
            try:
                entries = self.buffer.read(max_count=need * 2, block_ms=500)
            except BufferUnavailable as exc:
                log.error("buffer read failed: Redis unavailable (%s); retrying in 1s", exc)
                self.stop_event.wait(1.0)
                continue
            last_arrival = time.time() if entries else last_arrival
            dropped["invalid"] += self._take(entries, step)

    def _count_flat(self, flat: int, found_usable: bool) -> None:
        """Warn when algo.dynamic_sampling has dropped FLAT_WARN_STEPS steps' worth of groups in a row (then at twice
        as many, and so on): without it a run whose every group has equal rewards waits for ever, in silence."""
        self.flat_streak = 0 if found_usable else self.flat_streak + flat
        if found_usable:
            self.flat_warn_at = FLAT_WARN_STEPS * self.need
        elif self.flat_streak >= self.flat_warn_at:
            self.flat_warn_at *= 2
            log.warning("the last %d groups all had zero reward variance (every completion of a group got the same "
                        "reward; with algo.overlong=filter, the completions not truncated did) and "
                        "algo.dynamic_sampling dropped them: no step can be made of them. Check the task's rewards on "
                        "the samplers (all correct: too easy; all wrong: too hard, or answers the reward cannot parse; "
                        "all truncated: raise generation.max_new_tokens), or set algo.dynamic_sampling=false to train "
                        "on them anyway",
                        self.flat_streak)

    def _note(self, step: int, dropped: dict[str, int], waited: float, quiet: float) -> None:
        """The waiting step's note: what it has, what it dropped meanwhile, and what to check when nothing came
        for QUIET_WARN_S (`quiet`: seconds since a group was last read)."""
        depth = when_available("reading the buffer depth", self.buffer.depth, self.stop_event)
        unread = depth - self.held() - len(self.pending)
        log.info("step %d waiting for rollouts for %.0fs: %d/%d usable groups; dropped meanwhile: %s; %d more in "
                 "the buffer%s", step, waited, len(self.pending), self.need,
                 ", ".join(f"{n} {why}" for why, n in dropped.items()), unread,
                 f"; samplers: {self.samplers()}" if self.samplers is not None else "")
        if quiet >= QUIET_WARN_S and unread <= 0:
            log.warning("step %d: no group arrived in the last %.0fs: check that the samplers run and reach this "
                        "trainer (their logs, `grpo-stream status`), and that their run.name and redis.url are this "
                        "run's", step, quiet)
        if self.waiting is not None:
            self.waiting()

    def _take(self, entries: list[BufferEntry], step: int) -> int:
        """Decode what was read into `pending`; an entry this trainer cannot train is settled as dropped_invalid with
        its reasons logged (returns how many). Without this a group that decodes but does not fit (accepted under
        another config, or damaged in Redis) would fail the step, and again after every restart, since it is read
        first."""
        invalid = []
        for entry in entries:
            try:
                self.pending.append((entry, decode_trainable_group(entry.payload, self.limits)))
            except Exception as exc:  # noqa: BLE001 - a corrupt entry must not stop training
                log.error("buffer entry %s (group %s) dropped as invalid: it cannot be trained under this trainer's "
                          "config (accepted under other generation limits, or damaged in Redis): %s",
                          entry.entry_id, entry.group_id, exc)
                invalid.append((entry.entry_id, entry.group_id, "dropped_invalid", step))
        if invalid:
            when_available("settling invalid groups", lambda: self.buffer.settle(invalid), self.stop_event)
        return len(invalid)
