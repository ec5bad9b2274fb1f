"""The rollout buffer: one interface, a Redis-streams backend and an in-memory one for unit tests.

Redis layout for run R (prefix P):
  P:R:rollouts      stream, one entry per group, field `g` = RolloutGroup protobuf bytes
  P:R:counters      hash: ingested, trained, dropped_stale, dropped_invalid, dropped_filtered
  P:R:by_sampler    hash: sampler id -> groups ingested

Every change to the stream and to the counters happens in one MULTI/EXEC
transaction, so at any moment
    ingested == trained + dropped_stale + dropped_invalid + dropped_filtered + XLEN(rollouts).
The trainer reads through a consumer group and deletes entries once it has
trained on them or dropped them; entries read but not yet settled stay in
the stream (and count as left in the buffer).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import threading
import time

import redis

COUNTERS = ("ingested", "trained", "dropped_stale", "dropped_invalid", "dropped_filtered")


class BufferFull(Exception):
    """The buffer holds max_groups or more: the producer must wait and retry."""


class BufferUnavailable(Exception):
    """The backend cannot be reached; nothing was written."""


@dataclasses.dataclass(frozen=True)
class BufferEntry:
    entry_id: str
    payload: bytes


class RolloutBuffer(abc.ABC):
    """Where ingested groups wait for the trainer."""

    @abc.abstractmethod
    def append_many(self, items: list[tuple[bytes, str]], max_groups: int) -> tuple[int, int]:
        """Append encoded groups (payload, sampler id), in order, while the buffer holds fewer than
        max_groups; return (how many were appended, new depth). Those not appended were not written
        and may be sent again. Raises BufferUnavailable (nothing written) when the backend is down."""

    def append(self, payload: bytes, sampler_id: str, max_groups: int) -> int:
        """Append one encoded group; return the new depth. Raises BufferFull / BufferUnavailable."""
        appended, depth = self.append_many([(payload, sampler_id)], max_groups)
        if not appended:
            raise BufferFull(f"buffer holds {depth} groups (buffer.max_groups={max_groups})")
        return depth

    @abc.abstractmethod
    def read(self, max_count: int, block_ms: int) -> list[BufferEntry]:
        """Up to max_count entries not yet delivered to this consumer; waits up to block_ms for the first."""

    @abc.abstractmethod
    def settle(self, trained=(), dropped_stale=(), dropped_invalid=(), dropped_filtered=()) -> None:
        """Remove entries (ids) for good and count each list under its name, atomically."""

    @abc.abstractmethod
    def depth(self) -> int:
        """Entries in the buffer, delivered-but-unsettled included."""

    @abc.abstractmethod
    def counters(self) -> dict[str, int]:
        """COUNTERS plus `depth`."""

    @abc.abstractmethod
    def ingested_by_sampler(self) -> dict[str, int]:
        ...


class RedisStreamBuffer(RolloutBuffer):
    """Redis streams with a consumer group; see the module docstring for the layout."""

    GROUP = "trainer"

    def __init__(self, client: redis.Redis, run_name: str, prefix: str = "grpo-stream", consumer: str = "trainer-0"):
        self.client = client
        base = f"{prefix}:{run_name}"
        self.stream, self.counters_key, self.by_sampler_key = f"{base}:rollouts", f"{base}:counters", f"{base}:by_sampler"
        self.consumer = consumer
        self._group_ready = False
        # a restarted trainer (same consumer name) first takes back what its predecessor read but never settled;
        # otherwise those entries would fill the stream for good and block the ingest
        self._recover_after: str | None = "0"

    def _call(self, fn):
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise BufferUnavailable(f"redis: {exc}") from exc

    def append_many(self, items: list[tuple[bytes, str]], max_groups: int) -> tuple[int, int]:
        # The capacity check and the write are two round trips, so concurrent
        # ingest threads may overshoot max_groups by at most one batch each:
        # the limit is back-pressure, not a hard memory bound.
        def run():
            depth = self.client.xlen(self.stream)
            room = max(0, min(len(items), max_groups - depth))
            if not room:
                return 0, depth
            pipe = self.client.pipeline(transaction=True)
            for payload, _ in items[:room]:
                pipe.xadd(self.stream, {"g": payload})
            pipe.hincrby(self.counters_key, "ingested", room)
            for sampler_id, n in collections.Counter(sid for _, sid in items[:room]).items():
                pipe.hincrby(self.by_sampler_key, sampler_id, n)
            pipe.xlen(self.stream)
            return room, int(pipe.execute()[-1])
        return self._call(run)

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
        def run():
            self._ensure_group()
            if self._recover_after is not None:  # this consumer's unsettled entries, each once, oldest first
                out = self._entries(self.client.xreadgroup(self.GROUP, self.consumer,
                                                           {self.stream: self._recover_after}, count=max_count))
                if out:
                    self._recover_after = out[-1].entry_id
                    return out
                self._recover_after = None
            return self._entries(self.client.xreadgroup(self.GROUP, self.consumer, {self.stream: ">"},
                                                        count=max_count, block=block_ms or None))
        return self._call(run)

    @staticmethod
    def _entries(reply) -> list[BufferEntry]:
        out = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                if fields is None:  # deleted while pending
                    continue
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                out.append(BufferEntry(eid, fields.get(b"g", b"")))
        return out

    def settle(self, trained=(), dropped_stale=(), dropped_invalid=(), dropped_filtered=()) -> None:
        named = {"trained": trained, "dropped_stale": dropped_stale, "dropped_invalid": dropped_invalid,
                 "dropped_filtered": dropped_filtered}
        ids = [i for group in named.values() for i in group]
        if not ids:
            return

        def run():
            pipe = self.client.pipeline(transaction=True)
            pipe.xack(self.stream, self.GROUP, *ids)
            pipe.xdel(self.stream, *ids)
            for name, group in named.items():
                if group:
                    pipe.hincrby(self.counters_key, name, len(group))
            pipe.execute()
        self._call(run)

    def depth(self) -> int:
        return int(self._call(lambda: self.client.xlen(self.stream)))

    def counters(self) -> dict[str, int]:
        def run():
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(self.counters_key)
            pipe.xlen(self.stream)
            raw, depth = pipe.execute()
            out = {name: int(raw.get(name.encode(), 0)) for name in COUNTERS}
            out["depth"] = int(depth)
            return out
        return self._call(run)

    def ingested_by_sampler(self) -> dict[str, int]:
        raw = self._call(lambda: self.client.hgetall(self.by_sampler_key))
        return {k.decode(): int(v) for k, v in raw.items()}


class InMemoryBuffer(RolloutBuffer):
    """Same semantics in one process (unit tests of logic only)."""

    def __init__(self):
        self._lock = threading.Condition()
        self._entries: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._delivered: set[str] = set()
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._by_sampler: collections.Counter[str] = collections.Counter()
        self._next = 0

    def append_many(self, items, max_groups):
        with self._lock:
            room = max(0, min(len(items), max_groups - len(self._entries)))
            for payload, sampler_id in items[:room]:
                self._next += 1
                self._entries[f"{self._next}-0"] = payload
                self._counters["ingested"] += 1
                self._by_sampler[sampler_id] += 1
            self._lock.notify_all()
            return room, len(self._entries)

    def read(self, max_count, block_ms):
        deadline = time.monotonic() + block_ms / 1000
        with self._lock:
            while True:
                fresh = [(k, v) for k, v in self._entries.items() if k not in self._delivered][:max_count]
                if fresh or time.monotonic() >= deadline:
                    break
                self._lock.wait(max(0.0, deadline - time.monotonic()))
            self._delivered.update(k for k, _ in fresh)
            return [BufferEntry(k, v) for k, v in fresh]

    def settle(self, trained=(), dropped_stale=(), dropped_invalid=(), dropped_filtered=()):
        named = {"trained": trained, "dropped_stale": dropped_stale, "dropped_invalid": dropped_invalid,
                 "dropped_filtered": dropped_filtered}
        with self._lock:
            for name, group in named.items():
                for eid in group:
                    if self._entries.pop(eid, None) is not None:
                        self._counters[name] += 1
                    self._delivered.discard(eid)

    def depth(self):
        with self._lock:
            return len(self._entries)

    def counters(self):
        with self._lock:
            return {**self._counters, "depth": len(self._entries)}

    def ingested_by_sampler(self):
        with self._lock:
            return dict(self._by_sampler)
