"""The rollout buffer in memory: the same contract as RedisStreamBuffer (ordering, de-duplication by group id,
room counted in groups not yet trained, idempotent settling, the accounting identity, the audit trail) inside one
process. For unit tests of the trainer loop and single-process experiments; nothing survives the process, and
injected prompts (which live in Redis) are answered 'unknown'."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable, Sequence

from grpo_stream.common.rollouts import compaction_holes
from grpo_stream.common.rollouts.audit_compaction import COMPACTED_COUNTS, CompactionPlan, plan_compaction
from grpo_stream.common.rollouts.buffer import COUNTERS, OUTCOMES, REFUSALS, AdmissionState, BufferEntry, Incoming


class InMemoryBuffer:
    def __init__(self):
        self._lock = threading.Condition()
        self._stream: collections.OrderedDict[str, BufferEntry] = collections.OrderedDict()
        self._next = 0
        self._delivered: set[str] = set()  # read by the (one) consumer and not yet settled
        self._counts = dict.fromkeys(COUNTERS + REFUSALS, 0)
        self._by_sampler: dict[str, int] = {}
        self._positions: dict[str, int] = {}
        self._accepted: dict[str, dict] = {}  # group id -> {sampler, position}; the de-duplication set
        self.compacted = {"through_step": 0, **dict.fromkeys(COMPACTED_COUNTS, 0)}
        self.through_epoch = ""  # the trainer whose lineage step through_step is (Redis: audit:compacted's)
        self.below: dict[str, int] = {}  # sampler -> data position at or below which every group is compacted
        self.holes: dict[str, str] = {}  # sampler -> positions below it never accepted (compaction_holes.py)
        self.settled: dict[str, dict] = {}  # group id -> {outcome, step, entry}
        self.steps: list[dict] = []
        self._step_records = 0
        self.trainers: list[dict] = []
        self.checkpoints: list[dict] = []
        self._held = 0

    def append_many(self, items: Sequence[Incoming], max_groups: int, refused_invalid: int = 0,
                    retention_s: int = 7 * 86_400, max_kept: int = 10_000) -> tuple[list[str], int]:
        with self._lock:
            self._counts["refused_invalid"] += refused_invalid
            room = max_groups - (len(self._stream) - self._held)
            statuses = []
            for item in items:
                past = compaction_holes.compacted_position(self.below, self.holes, item.sampler_id,
                                                           item.data_position)
                if item.injected_prompt:
                    statuses.append("unknown")
                elif item.group_id in self._accepted or past == "dup":
                    statuses.append("dup")
                    self._counts["refused_duplicate"] += 1
                elif room <= 0:
                    statuses.append("full")
                    self._counts["refused_full"] += 1
                else:
                    self._next += 1
                    entry_id = f"{self._next}-0"
                    self._stream[entry_id] = BufferEntry(entry_id, item.group_id, item.payload)
                    self._accepted[item.group_id] = {"sampler": item.sampler_id, "position": item.data_position}
                    if past == "hole":
                        compaction_holes.fill_hole(self.holes, item.sampler_id, item.data_position)
                    self._counts["ingested"] += 1
                    self._by_sampler[item.sampler_id] = self._by_sampler.get(item.sampler_id, 0) + 1
                    if item.data_position >= 0:
                        self._positions[item.sampler_id] = max(self._positions.get(item.sampler_id, -1),
                                                               item.data_position)
                    room -= 1
                    statuses.append(entry_id)
            self._lock.notify_all()
            return statuses, len(self._stream) - self._held

    def data_position(self, sampler_id: str) -> int | None:
        with self._lock:
            return self._positions.get(sampler_id)

    def unanswered_positions(self, sampler_id: str, below: int, window: int) -> list[int]:
        """RedisStreamBuffer.unanswered_positions."""
        with self._lock:
            accepted = {r["position"] for r in self._accepted.values() if r["sampler"] == sampler_id}
            return [p for p in range(max(0, below - window), below)
                    if (past := compaction_holes.compacted_position(self.below, self.holes, sampler_id, p)) == "hole"
                    or (past is None and p not in accepted)]

    def read(self, max_count: int, block_ms: int) -> list[BufferEntry]:
        deadline = time.monotonic() + block_ms / 1000
        with self._lock:
            while True:
                fresh = [e for eid, e in self._stream.items() if eid not in self._delivered][:max_count]
                if fresh or time.monotonic() >= deadline:
                    break
                self._lock.wait(deadline - time.monotonic())
            again = [e for e in fresh if e.group_id in self.settled]
            self._delivered.update(e.entry_id for e in fresh)
        if again:
            self.settle((e.entry_id, e.group_id, "dropped_duplicate", -1) for e in again)
        return [e for e in fresh if e not in again]

    def redeliver(self) -> None:
        """A restarted trainer: everything read but not settled is delivered again, oldest first."""
        with self._lock:
            self._delivered.clear()

    def settle(self, records: Iterable[tuple[str, str, str, int]]) -> int:
        records = list(records)
        for _, _, outcome, _ in records:
            if outcome not in OUTCOMES:
                raise ValueError(f"settle: unknown outcome {outcome!r}; one of {OUTCOMES}")
        n = 0
        with self._lock:
            for entry_id, group_id, outcome, step in records:
                if self._stream.pop(entry_id, None) is None:
                    continue
                self._delivered.discard(entry_id)
                self._counts[outcome] += 1
                if outcome != "dropped_duplicate":
                    self.settled[group_id] = {"outcome": outcome, "step": step, "entry": entry_id}
                n += 1
        return n

    def set_held(self, count: int) -> None:
        with self._lock:
            self._held = count

    def check_fence(self) -> None:
        """One process, one trainer: never fenced out."""

    def log_step(self, epoch: str, step: int, group_ids: list[str]) -> None:
        self._step_records += 1
        self.steps.append({"id": f"{int(time.time() * 1000)}-{self._step_records}", "epoch": epoch, "step": step,
                           "groups": list(group_ids)})

    def log_trainer(self, epoch: str, from_step: int, from_epoch: str) -> None:
        self.trainers.append({"epoch": epoch, "from_step": from_step, "from_epoch": from_epoch})

    def log_checkpoint(self, epoch: str, step: int) -> None:
        self.checkpoints.append({"epoch": epoch, "step": step})

    def compact_audit(self, through_step: int) -> CompactionPlan:
        with self._lock:
            plan = plan_compaction(through_step, self.compacted["through_step"], self._accepted, self.settled, {},
                                   self.steps, self.trainers, self.checkpoints, {}, self.below, self.holes,
                                   self.through_epoch)
            if plan.through_step > self.compacted["through_step"]:
                self.through_epoch = plan.through_epoch
                for name, n in plan.counts.items():
                    self.compacted[name] += n
                self.compacted["through_step"] = plan.through_step
                self.below.update(plan.below)
                self.holes.update(plan.holes)
                for sampler in [s for s, h in self.holes.items() if not h]:
                    del self.holes[sampler]
                for gid in plan.group_ids:
                    del self._accepted[gid]
                    self.settled.pop(gid, None)
                gone = set(plan.step_records)
                self.steps = [rec for rec in self.steps if rec["id"] not in gone]
            return plan

    def depth(self) -> int:
        with self._lock:
            return len(self._stream)

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {**self._counts, "depth": len(self._stream)}

    def ingested_by_sampler(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_sampler)

    def admission_state(self) -> AdmissionState:
        with self._lock:
            # clamped as Redis's is: a held count above the depth (a dead trainer's, before it is reset) waits 0
            return AdmissionState(max(0, len(self._stream) - self._held), self._counts["trained"],
                                  self._counts["dropped_filtered"], max(self.steps[-1]["step"] if self.steps else 0,
                                                                           self.compacted["through_step"]))
