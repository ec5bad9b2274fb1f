"""Streaming rollout groups to the ingest, with a bounded backlog and retries.

The generation loop `put`s finished groups; a background thread sends them
in order over one bidirectional `StreamBatches` call, one batch (what the
backlog holds, up to max_groups_per_message) in flight at a time, and keeps
each group until the ingest acknowledges it:
  OK                  -> done
  RESOURCE_EXHAUSTED  -> buffer full: wait retry_after_ms, send it again
  UNAVAILABLE / error -> reconnect with exponential backoff, send it again
  INVALID_ARGUMENT    -> the group can never be accepted: logged and counted
`put` blocks while the backlog is full, which pauses generation instead of
dropping work. Groups whose weight version fell below `min_version` (set by the
sampler to the newest version it installed minus trainer.max_staleness) are
discarded before sending and counted as `dropped_stale`: the trainer would
drop them, and sending them first would delay the fresh groups behind them.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import grpc

from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc
from grpo_stream.common.runtime.backoff import Backoff

log = logging.getLogger(__name__)

_OK, _INVALID, _EXHAUSTED = 0, grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


class _BadReply(Exception):
    """The ingest's answer does not match what was sent: reconnect and send again."""


class RolloutClient:
    def __init__(self, channel: grpc.Channel, backlog_max_groups: int, max_groups_per_message: int = 16):
        self._max_per_message = max_groups_per_message
        self._stub = rollout_pb2_grpc.RolloutIngestStub(channel)
        self._backlog: queue.Queue[rollout_pb2.RolloutGroup] = queue.Queue(maxsize=backlog_max_groups)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-sender", daemon=True)
        self.stats = collections.Counter()
        self._unacked = 0
        self._lock = threading.Lock()
        self.min_version = 0
        self.refused: str | None = None  # why the ingest refuses this sender for good (its token or its ids)

    def start(self) -> "RolloutClient":
        self._thread.start()
        return self

    def put(self, group: rollout_pb2.RolloutGroup, timeout_s: float) -> bool:
        """Queue a group, waiting up to timeout_s while the backlog is full; False (not queued) on timeout.
        PermissionError once the ingest has refused this sender's token or sampler ids: retrying cannot help."""
        if self.refused is not None:
            raise PermissionError(self.refused)
        try:
            self._backlog.put(group, timeout=timeout_s)
        except queue.Full:
            return False
        with self._lock:
            self._unacked += 1
        return True

    @property
    def unacked(self) -> int:
        with self._lock:
            return self._unacked

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued group is acknowledged; True if it happened in time."""
        deadline = time.monotonic() + timeout_s
        while self.unacked and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.unacked == 0

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _take(self, pending: list) -> list:
        """Groups to send next: the ones still in hand, else what the backlog holds (waits briefly); too stale
        ones are discarded on the way."""
        if pending:
            return self._fresh(pending)
        try:
            batch = [self._backlog.get(timeout=0.2)]
        except queue.Empty:
            return []
        while len(batch) < self._max_per_message:
            try:
                batch.append(self._backlog.get_nowait())
            except queue.Empty:
                break
        return self._fresh(batch)

    def _fresh(self, groups: list) -> list:
        floor = self.min_version
        fresh = [g for g in groups if g.policy_version >= floor]
        if len(fresh) < len(groups):
            self.stats["dropped_stale"] += len(groups) - len(fresh)
            with self._lock:
                self._unacked -= len(groups) - len(fresh)
        return fresh

    def _settle(self, pending: list, acks) -> tuple[list, int]:
        """Count the acks of one batch; return (groups to send again, retry delay in ms)."""
        if len(acks) != len(pending):
            raise _BadReply(f"ingest answered {len(acks)} acks for {len(pending)} groups")
        again, retry_ms = [], 0
        for group, ack in zip(pending, acks):
            if ack.code == _OK:
                self.stats["accepted"] += 1
            elif ack.code == _INVALID:
                self.stats["rejected_invalid"] += 1
                log.error("ingest rejected group %s: %s", ack.group_id, ack.message)
            else:
                self.stats["retried"] += 1
                again.append(group)
                retry_ms = max(retry_ms, ack.retry_after_ms, 10)
        with self._lock:
            self._unacked -= len(pending) - len(again)
        return again, retry_ms

    def _run(self) -> None:
        pending: list[rollout_pb2.RolloutGroup] = []  # taken from the backlog, not yet acknowledged
        backoff = Backoff(0.1, 5.0)
        while not self._stop.is_set():
            try:
                requests: queue.Queue = queue.Queue()

                def request_iter():
                    while True:
                        item = requests.get()
                        if item is None:
                            return
                        yield item

                call = self._stub.StreamBatches(request_iter())
                try:
                    while not self._stop.is_set():
                        pending = self._take(pending)
                        if not pending:
                            continue
                        requests.put(rollout_pb2.RolloutBatch(groups=pending))
                        pending, retry_ms = self._settle(pending, next(call).acks)
                        backoff.reset()
                        if pending:  # buffer full or unavailable: the same groups again, in order
                            self._stop.wait(retry_ms / 1000)  # (close() ends the wait)
                finally:
                    requests.put(None)
                    call.cancel()
            except (grpc.RpcError, StopIteration, _BadReply) as exc:
                if self._stop.is_set():
                    break
                if isinstance(exc, grpc.RpcError) and exc.code() in (grpc.StatusCode.PERMISSION_DENIED,
                                                                     grpc.StatusCode.UNAUTHENTICATED):
                    self.refused = (f"the ingest refused this sampler's groups ({exc.code().name}: {exc.details()}); "
                                    "check its token (auth.token_file, $GRPO_STREAM_TOKEN_FILE) and its sampler id")
                    log.error("%s; %d groups not sent", self.refused, len(pending) + self._backlog.qsize())
                    break
                self.stats["reconnects"] += 1
                code = exc.code() if isinstance(exc, grpc.RpcError) else (str(exc) or "stream closed")
                delay = backoff.next()
                log.warning("rollout stream to ingest failed (%s); retrying in %.1fs with %d groups in hand", code,
                            delay, len(pending))
                self._stop.wait(delay)
