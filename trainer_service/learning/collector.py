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
                 waiting: Callable[[], None] | None = None):
        """`no_signal`: algo.dynamic_sampling's test of a group (batching.no_signal_test; None: off). `limits`: what
        a group this trainer can train looks like (its generation section and vocabulary); others are settled as
        dropped_invalid. `waiting`: called every 10 s while a step waits for groups (a heartbeat: waiting for
        samplers is not hanging)."""
        self.waiting, self.limits = waiting, limits
        self.buffer, self.need, self.max_staleness = buffer, groups_per_step, max_staleness
        self.no_signal, self.stop_event, self.held = no_signal, stop_event, held
        self.pending: list[tuple[BufferEntry, GroupData]] = []

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
        last_note = time.time()
        while True:
            batch, stale, flat, rest = select_batch(self.pending, need, step - 1, holding, self.no_signal)
            if stale or flat:
                when_available("settling dropped groups", lambda: self.buffer.settle(
                    [(e.entry_id, e.group_id, "dropped_stale", step) for e, _ in stale]
                    + [(e.entry_id, e.group_id, "dropped_filtered", step) for e, _ in flat]), self.stop_event)
            if stale:
                detail.info("dropped %d stale groups (versions %s, trainer at %d, max_staleness %d)", len(stale),
                            sorted({g.policy_version for _, g in stale}), step - 1, holding)
            if len(batch) == need:
                self.pending = rest
                return batch
            self.pending = batch
            if self.stop_event.is_set() or (cancel is not None and cancel.is_set()):
                return None
            try:
                entries = self.buffer.read(max_count=need * 2, block_ms=500)
            except BufferUnavailable as exc:
                log.error("buffer read failed: Redis unavailable (%s); retrying in 1s", exc)
                self.stop_event.wait(1.0)
                continue
            self._take(entries, step)
            if time.time() - last_note > 10:
                depth = when_available("reading the buffer depth", self.buffer.depth, self.stop_event)
                log.info("step %d waiting for rollouts: %d/%d groups, %d more waiting in the buffer", step,
                         len(self.pending), need, depth - self.held() - len(self.pending))
                last_note = time.time()
                if self.waiting is not None:
                    self.waiting()

    def _take(self, entries: list[BufferEntry], step: int) -> None:
        """Decode what was read into `pending`; an entry this trainer cannot train is settled as dropped_invalid
        with its reasons logged. Without this a group that decodes but does not fit (accepted under another config,
        or damaged in Redis) would fail the step, and again after every restart, since it is read first."""
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
