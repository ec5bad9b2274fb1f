"""The rollout buffer: Redis streams with a consumer group, de-duplication by group id, and an audit trail.

Redis layout for run R (prefix P):
  P:R:rollouts         stream, one entry per accepted group: `g` = RolloutGroup bytes, `id` = its group id
  P:R:counters         hash: ingested, trained, dropped_{stale,invalid,filtered,duplicate} (the identity below),
                       and the ingest's refusals: refused_{invalid,duplicate,full}
  P:R:by_sampler       hash: sampler id -> groups accepted
  P:R:positions        hash: sampler id -> highest data position accepted (where a restarted sampler resumes)
  P:R:held             entries the trainer trained but has not acknowledged yet (its checkpoint window)
  P:R:audit:accepted   hash: group id -> {entry, sampler, version, position, t}; also the de-duplication set
  P:R:audit:settled    hash: group id -> {outcome, step, entry, t}
  P:R:audit:duplicates hash: group id -> times a second copy reached the trainer (never trained)
  P:R:audit:steps      stream: per RL step, the trainer epoch, step and group ids it trained
  P:R:audit:trainers   stream: per trainer process, its epoch and the checkpoint (step, epoch) it resumed from
  P:R:audit:checkpoints stream: per saved checkpoint, its step and epoch (compacted: each trainer's newest)
  P:R:audit:eval       hash: group id -> {prompt, sampler, version, t} of injected train=false answers (never
                       appended to the stream; see trainer_service/ingest/prompt_queue.py for the injection keys)
  P:R:audit:compacted  hash: the records settled behind the acknowledged checkpoint, folded into counts, and
                       per sampler the data position below which every group is compacted (audit_compaction.py)
  P:R:trainer:fence    the fencing number of the newest trainer start; P:R:trainer:lease its lease (trainer_lease.py)

Appending and settling are Lua scripts (buffer_scripts.py), so each is atomic and at any moment
    ingested == trained + dropped_stale + dropped_invalid + dropped_filtered + dropped_duplicate + XLEN(rollouts).
Settling is idempotent: only an entry that is still in the stream is counted (a trainer that re-settles after a
crash counts nothing twice). The trainer settles trained groups only after the checkpoint holding their update is
saved; until then they stay pending in the consumer group and a restarted trainer reads them again.
Every write of a trainer carries its fencing number (`use_fence`), which the scripts check: a trainer that a newer
one took the run from is refused (StaleTrainer) and stops.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Callable, Protocol

import redis

from grpo_stream.common.rollouts.audit_compaction import CompactionPlan, compact_redis, text
from grpo_stream.common.rollouts.buffer_scripts import APPEND, SETTLE, UNANSWERED
from grpo_stream.common.rollouts.fencing import FENCE_CHECK, FENCED_CALL, StaleTrainer, is_stale_reply
from grpo_stream.common.rollouts.kept_results import group_id_prefix
from grpo_stream.common.rollouts.redis_errors import BufferUnavailable, redis_call  # noqa: F401 (the interface's error)
from grpo_stream.common.rollouts.redis_errors import DamagedRecord, integer_of, wrong_type

COUNTERS = ("ingested", "trained", "dropped_stale", "dropped_invalid", "dropped_filtered", "dropped_duplicate")
REFUSALS = ("refused_invalid", "refused_duplicate", "refused_full")
OUTCOMES = COUNTERS[1:]
RUN_FILE = "run.json"  # in RUN_DIR: the run name and (password-free) Redis URL, for `grpo-stream audit`
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BufferEntry:
    entry_id: str
    group_id: str
    payload: bytes


@dataclasses.dataclass(frozen=True)
class Incoming:
    """A validated group as the ingest hands it to the buffer."""

    group_id: str
    sampler_id: str
    policy_version: int
    data_position: int  # -1 when the group has none (e.g. an injected prompt)
    payload: bytes
    injected_prompt: str = ""  # the injected prompt this group answers ('' for dataset prompts)


class RolloutBuffer(Protocol):
    """The rollout-buffer link: where accepted groups wait for the trainer, and the audit trail of what became of
    each. The ingest appends, the trainer reads, settles and logs; `audit` reads the trail. Backends: Redis
    (RedisStreamBuffer, every deployment) and in memory (memory_buffer.py, one process: tests of the trainer loop);
    see registry.py. Every backend keeps the accounting identity
        ingested == trained + dropped_stale + dropped_invalid + dropped_filtered + dropped_duplicate + depth
    and settles idempotently."""

    def append_many(self, items: Sequence["Incoming"], max_groups: int, refused_invalid: int = 0,
                    retention_s: int = 7 * 86_400, max_kept: int = 10_000) -> tuple[list[str], int]: ...

    def data_position(self, sampler_id: str) -> int | None: ...

    def unanswered_positions(self, sampler_id: str, below: int, window: int) -> list[int]: ...

    def read(self, max_count: int, block_ms: int) -> list["BufferEntry"]: ...

    def settle(self, records: Iterable[tuple[str, str, str, int]]) -> int: ...

    def set_held(self, count: int) -> None: ...

    def check_fence(self) -> None: ...

    def log_step(self, epoch: str, step: int, group_ids: list[str]) -> None: ...

    def log_trainer(self, epoch: str, from_step: int, from_epoch: str) -> None: ...

    def log_checkpoint(self, epoch: str, step: int) -> None: ...

    def compact_audit(self, through_step: int) -> "CompactionPlan": ...

    def depth(self) -> int: ...

    def counters(self) -> dict[str, int]: ...

    def ingested_by_sampler(self) -> dict[str, int]: ...

    def admission_state(self) -> "AdmissionState": ...


@dataclasses.dataclass(frozen=True)
class AdmissionState:
    """What admission control reads from the buffer, in one round trip."""

    waiting: int  # groups not trained yet: waiting, or read for the step in progress
    trained: int
    dropped_filtered: int  # passed over for zero reward variance (dynamic sampling): they take no step's place
    trainer_step: int  # the last step the trainer logged (0 before the first)


def keys(prefix: str, run_name: str) -> dict[str, str]:
    base = f"{prefix}:{run_name}"
    return {name: f"{base}:{name}" for name in (
        "rollouts", "counters", "by_sampler", "positions", "held", "audit:accepted", "audit:settled", "audit:duplicates",
        "audit:steps", "audit:trainers", "audit:checkpoints", "audit:eval", "audit:compacted", "trainer:fence",
        "trainer:lease")}


class RedisStreamBuffer:
    """Where ingested groups wait for the trainer; see the module docstring for the layout and guarantees."""

    GROUP = "trainer"
    PENDING_CHECK_S = 5.0

    def __init__(self, client: redis.Redis, run_name: str, prefix: str = "grpo-stream", consumer: str = "trainer-0"):
        self.client = client
        self.k = keys(prefix, run_name)
        self.base, self.run_name = f"{prefix}:{run_name}", run_name
        self.stream = self.k["rollouts"]
        self.consumer = consumer
        self._append = client.register_script(APPEND)
        self._settle = client.register_script(SETTLE)
        self._unanswered = client.register_script(UNANSWERED)
        self._fenced = client.register_script(FENCED_CALL)
        self._fence_check = client.register_script(FENCE_CHECK)
        self.fence = ""  # this writer's fencing number ('': not a trainer's writes, unchecked)
        self._on_stale: Callable[[str], None] | None = None
        self._group_ready = False
        # a restarted trainer (same consumer name) first takes back what its predecessor read but never settled,
        # oldest first, so it sees the groups in the order the stream holds them
        self._recover_after: str | None = "0"
        # entries this consumer returned and has not settled: what its pending list should hold. An entry Redis
        # delivered whose reply never arrived (the connection died mid-reply; redis-py then retries the read) is
        # pending too but unknown here, so no read returns it again: `_lost_deliveries` takes those back.
        self._delivered: set[str] = set()
        self._next_pending_check = 0.0

    def _call(self, fn):
        try:
            return redis_call(fn)
        except (redis.ResponseError, StaleTrainer) as exc:
            if not is_stale_reply(exc):
                raise
            message = f"trainer of run {self.run_name}: {exc}"
            if self._on_stale is not None:
                self._on_stale(message)  # the trainer stops here
            raise StaleTrainer(message) from None

    def use_fence(self, fence: str, on_stale: Callable[[str], None] | None = None) -> None:
        """Make every write carry fencing number `fence` (the trainer's lease, trainer_lease.py); a write refused as
        stale calls `on_stale(message)` (the trainer's: stop the process), then raises StaleTrainer."""
        self.fence, self._on_stale = fence, on_stale

    def _fenced_call(self, key: str, *command) -> object:
        """One command on `key` (SET, XADD: `command` is its name and the arguments after the key), made only while
        this writer's fence is the run's (one script call: the check and the write are atomic)."""
        return self._call(lambda: self._fenced(keys=[self.k["trainer:fence"], key], args=[self.fence, *command]))

    # -- the ingest's side ---------------------------------------------------------
    def append_many(self, items: Sequence[Incoming], max_groups: int, refused_invalid: int = 0,
                    retention_s: int = 7 * 86_400, max_kept: int = 10_000) -> tuple[list[str], int]:
        """Append groups in order while fewer than max_groups wait to be trained. Returns one status per item (an entry
        id: appended; 'dup': this group id was accepted before, nothing written; 'full': not written, send again
        later) and how many groups then wait. Raises BufferUnavailable (nothing written) when Redis is down.

        An injected prompt's answer (item.injected_prompt) is recorded as its result (kept `retention_s`, or until
        `max_kept` newer prompts finished: common/rollouts/kept_results.py) and only
        appended when the prompt was submitted with train=true ('eval' otherwise); 'cancelled': the prompt was
        cancelled, nothing kept; 'unknown': no such prompt (expired or never submitted)."""
        args: list = [self.GROUP, max_groups, time.time(), refused_invalid, self.base, retention_s, max_kept,
                      group_id_prefix(self.run_name), self.fence]
        for item in items:
            args += [item.group_id, item.sampler_id, item.policy_version, item.data_position, item.payload,
                     item.injected_prompt]
        k = self.k
        reply = self._call(lambda: self._append(
            keys=[self.stream, k["counters"], k["by_sampler"], k["audit:accepted"], k["positions"], k["held"],
                  k["audit:eval"], k["audit:compacted"], k["trainer:fence"]], args=args))
        waiting, *statuses = (text(r) for r in reply)
        return statuses, int(waiting)

    def data_position(self, sampler_id: str) -> int | None:
        """Highest data position accepted from `sampler_id` (None: nothing yet); DamagedRecord when it is no number."""
        raw = self._call(lambda: self.client.hget(self.k["positions"], sampler_id))
        return None if raw is None else integer_of(raw, self.k["positions"], sampler_id)

    def unanswered_positions(self, sampler_id: str, below: int, window: int) -> list[int]:
        """The data positions of `sampler_id` in [below - window, below) it has no accepted group at: groups still
        in flight or unsent when it stopped (groups end out of order), prompts it skipped. A group id names its
        position (run/sampler/position), so each is one lookup in the accepted set, or, at or below the compacted
        watermark, in its holes (compaction_holes.py)."""
        return [int(p) for p in self._call(lambda: self._unanswered(
            keys=[self.k["audit:accepted"], self.k["audit:compacted"]],
            args=[sampler_id, below, max(0, below - window), f"{self.run_name}/{sampler_id}/"]))]

    # -- the trainer's side --------------------------------------------------------
    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.stream, self.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def read(self, max_count: int, block_ms: int) -> list[BufferEntry]:
        """Up to max_count entries not yet delivered to this consumer, oldest first; waits up to block_ms for the
        first. An entry whose group id was already settled (a second copy) is settled as dropped_duplicate here
        and not returned."""
        def run():
            self._ensure_group()
            if self._recover_after is not None:  # this consumer's unsettled entries, each once, oldest first
                reply = self.client.xreadgroup(self.GROUP, self.consumer, {self.stream: self._recover_after},
                                               count=max_count)
                if reply and reply[0][1]:  # advance past entries deleted while pending too, not only live ones
                    self._recover_after = text(reply[0][1][-1][0])
                    return self._entries(reply)
                self._recover_after = None
            # first (older), not only when a read comes back empty: a stream kept fed never does, so they waited
            return self._lost_deliveries(max_count) or self._entries(self.client.xreadgroup(
                self.GROUP, self.consumer, {self.stream: ">"}, count=max_count, block=block_ms or None))
        try:
            entries = self._call(run)
            if not entries:
                return entries
            # delivered only once this read has fully answered: if the check or the duplicates' settle below fails,
            # the entries stay pending and not delivered, so _lost_deliveries takes them back rather than strand
            # them until a restart (marked first, a failed settle left the fresh ones never returned nor taken back)
            seen = self._call(lambda: self.client.hmget(self.k["audit:settled"], [e.group_id for e in entries]))
        except redis.ResponseError as exc:  # contents grpo-stream did not leave: named, not a bare Redis refusal
            raise self._damaged_read(exc) from None
        again = [e for e, s in zip(entries, seen) if s is not None]
        if again:
            self.settle((e.entry_id, e.group_id, "dropped_duplicate", -1) for e in again)
        fresh = [e for e, s in zip(entries, seen) if s is None]
        self._delivered.update(e.entry_id for e in fresh)
        return fresh

    def _damaged_read(self, exc: redis.ResponseError) -> Exception:
        if str(exc).startswith("NOGROUP"):
            return DamagedRecord(f"{self.stream}: its consumer group {self.GROUP!r} is gone (the key or the group was "
                                 "deleted, or Redis lost its data), so what this trainer read and holds is tracked no "
                                 "more; start the trainer again (it resumes from its last checkpoint and reads every "
                                 "group still in the stream)")
        return redis_call(lambda: wrong_type(self.client, exc, {self.stream: "stream",
                                                                self.k["audit:settled"]: "hash"}))

    def _lost_deliveries(self, max_count: int) -> list[BufferEntry]:
        """Up to max_count entries pending for this consumer that it never returned, oldest first (checked at most
        every PENDING_CHECK_S, or at once while more remain). Without this a lost reply strands its entries: they
        count in the depth admission control reads, so samplers are refused places the trainer can never fill."""
        now = time.monotonic()
        if now < self._next_pending_check:
            return []
        self._next_pending_check = now + self.PENDING_CHECK_S
        summary = self.client.xpending(self.stream, self.GROUP)
        mine = sum(int(c["pending"]) for c in summary.get("consumers") or []
                   if text(c["name"]) == self.consumer)
        if mine <= len(self._delivered):
            return []
        rows = self.client.xpending_range(self.stream, self.GROUP, "-", "+", mine, consumername=self.consumer)
        lost = [eid for eid in (text(r["message_id"]) for r in rows) if eid not in self._delivered]
        if not lost:
            return []
        if len(lost) > max_count:
            lost, self._next_pending_check = lost[:max_count], 0.0
        # claiming them for this same consumer returns them, and drops from the pending list any deleted since
        out = self._entries([(self.stream, self.client.xclaim(self.stream, self.GROUP, self.consumer, 0, lost))])
        log.warning("took back %d buffer entries Redis delivered to %s whose reply was lost (a connection failure "
                    "mid-read): %s", len(out), self.consumer, [e.entry_id for e in out][:5])
        return out

    @staticmethod
    def _entries(reply) -> list[BufferEntry]:
        out = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                if not fields:  # deleted while pending
                    continue
                # an id that is not UTF-8 (damaged contents) must not fail the read: the group is then refused whole
                group_id = fields.get(b"id", b"").decode(errors="replace")
                out.append(BufferEntry(text(entry_id), group_id, fields.get(b"g", b"")))
        return out

    def settle(self, records: Iterable[tuple[str, str, str, int]]) -> int:
        """Remove entries for good, recording (entry id, group id, outcome, step) each; outcome is one of OUTCOMES.
        Idempotent; returns how many were still in the stream (and so counted now)."""
        args: list = [self.GROUP, time.time(), self.fence]
        for entry_id, group_id, outcome, step in records:
            if outcome not in OUTCOMES:
                raise ValueError(f"settle: unknown outcome {outcome!r}; one of {OUTCOMES}")
            args += [entry_id, group_id, outcome, step]
        if len(args) == 3:
            return 0
        k = self.k
        counted = int(self._call(lambda: self._settle(
            keys=[self.stream, k["counters"], k["audit:settled"], k["audit:duplicates"], k["trainer:fence"]],
            args=args)))
        self._delivered.difference_update(args[3::4])
        return counted

    def check_fence(self) -> None:
        """Raise StaleTrainer (after `on_stale`) when a newer trainer took the run: what a trainer checks right
        before it writes outside Redis (a checkpoint), where no script can check its fence. Writes nothing."""
        if self.fence:
            self._call(lambda: self._fence_check(keys=[self.k["trainer:fence"]], args=[self.fence]))

    def set_held(self, count: int) -> None:
        """How many entries the trainer trained and holds unacknowledged (not counted against max_groups)."""
        self._fenced_call(self.k["held"], "SET", count)

    def log_step(self, epoch: str, step: int, group_ids: list[str]) -> None:
        """Audit: the groups trainer `epoch` trained at `step` (before any checkpoint holds it)."""
        self._fenced_call(self.k["audit:steps"], "XADD", "*", "epoch", epoch, "step", step, "groups",
                          json.dumps(group_ids))

    def log_trainer(self, epoch: str, from_step: int, from_epoch: str) -> None:
        """Audit: trainer `epoch` started from the checkpoint of `from_step` written by `from_epoch` ('' = fresh)."""
        self._fenced_call(self.k["audit:trainers"], "XADD", "*", "epoch", epoch, "from_step", from_step,
                          "from_epoch", from_epoch, "t", time.time())

    def log_checkpoint(self, epoch: str, step: int) -> None:
        """Audit: trainer `epoch` saved a checkpoint of `step` (so steps up to it survive a crash)."""
        self._fenced_call(self.k["audit:checkpoints"], "XADD", "*", "epoch", epoch, "step", step)

    def compact_audit(self, through_step: int) -> CompactionPlan:
        """Fold the trail of groups settled up to `through_step` (acknowledged: never rolled back) into counts."""
        fence = (self.k["trainer:fence"], self.fence) if self.fence else None
        return self._call(lambda: compact_redis(self.client, self.k, through_step, fence))

    # -- both ----------------------------------------------------------------------
    def depth(self) -> int:
        """Entries in the stream: waiting, read, and trained but not yet checkpointed."""
        return int(self._call(lambda: self.client.xlen(self.stream)))

    def counters(self) -> dict[str, int]:
        """COUNTERS, REFUSALS and `depth`."""
        def run():
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(self.k["counters"])
            pipe.xlen(self.stream)
            raw, depth = pipe.execute()
            out = {name: integer_of(raw.get(name.encode(), 0), self.k["counters"], name)
                   for name in COUNTERS + REFUSALS}
            out["depth"] = int(depth)
            return out
        return self._call(run)

    def ingested_by_sampler(self) -> dict[str, int]:
        raw = self._call(lambda: self.client.hgetall(self.k["by_sampler"]))
        return {k.decode(): integer_of(v, self.k["by_sampler"], k.decode()) for k, v in raw.items()}

    def admission_state(self) -> AdmissionState:
        def run():
            pipe = self.client.pipeline(transaction=True)
            pipe.xlen(self.stream)
            pipe.get(self.k["held"])
            pipe.hmget(self.k["counters"], "trained", "dropped_filtered")
            pipe.xrevrange(self.k["audit:steps"], count=1)
            pipe.hget(self.k["audit:compacted"], "through_step")
            depth, held, (trained, filtered), last, compacted = pipe.execute()
            # a damaged step record or watermark (audit_trail.py reports it) must not stop admission: read as 0
            step = max(_int_or_zero(last[0][1].get(b"step")) if last else 0, _int_or_zero(compacted))
            counters = self.k["counters"]
            return AdmissionState(max(0, int(depth) - integer_of(held or 0, self.k["held"])),
                                  integer_of(trained or 0, counters, "trained"),
                                  integer_of(filtered or 0, counters, "dropped_filtered"), step)
        return self._call(run)


def _int_or_zero(raw) -> int:
    try:
        return int(raw or 0)
    except ValueError:
        return 0
