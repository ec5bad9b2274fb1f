"""Streaming rollout groups to the ingest, with a bounded backlog and retries.

The generation loop `put`s finished groups; a background thread sends them
in order over one bidirectional `StreamGroups` call, one group in flight at
a time, and keeps each group until the ingest acknowledges it:
  OK                  -> done
  RESOURCE_EXHAUSTED  -> buffer full: wait retry_after_ms, send it again
  UNAVAILABLE / error -> reconnect with exponential backoff, send it again
  INVALID_ARGUMENT    -> the group can never be accepted: logged and counted
`put` blocks while the backlog is full, which pauses generation instead of
dropping work.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import grpc

from protos import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

_OK, _INVALID, _EXHAUSTED = 0, grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


class RolloutClient:
    def __init__(self, channel: grpc.Channel, backlog_max_groups: int):
        self._stub = rollout_pb2_grpc.RolloutIngestStub(channel)
        self._backlog: queue.Queue[rollout_pb2.RolloutGroup] = queue.Queue(maxsize=backlog_max_groups)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-sender", daemon=True)
        self.stats = collections.Counter()
        self._unacked = 0
        self._lock = threading.Lock()

    def start(self) -> "RolloutClient":
        self._thread.start()
        return self

    def put(self, group: rollout_pb2.RolloutGroup, timeout_s: float) -> bool:
        """Queue a group, waiting up to timeout_s while the backlog is full; False (not queued) on timeout."""
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

    def _run(self) -> None:
        current: rollout_pb2.RolloutGroup | None = None
        delay = 0.1
        while not self._stop.is_set():
            try:
                requests: queue.Queue = queue.Queue()

                def request_iter():
                    while True:
                        item = requests.get()
                        if item is None:
                            return
                        yield item

                call = self._stub.StreamGroups(request_iter())
                try:
                    while not self._stop.is_set():
                        if current is None:
                            try:
                                current = self._backlog.get(timeout=0.2)
                            except queue.Empty:
                                continue
                        requests.put(current)
                        ack = next(call)
                        delay = 0.1
                        if ack.code == _OK:
                            self.stats["accepted"] += 1
                        elif ack.code == _INVALID:
                            self.stats["rejected_invalid"] += 1
                            log.error("ingest rejected group %s: %s", ack.group_id, ack.message)
                        else:
                            self.stats["retried"] += 1
                            time.sleep(max(ack.retry_after_ms, 10) / 1000)
                            continue  # resend the same group
                        current = None
                        with self._lock:
                            self._unacked -= 1
                finally:
                    requests.put(None)
                    call.cancel()
            except (grpc.RpcError, StopIteration) as exc:
                if self._stop.is_set():
                    break
                self.stats["reconnects"] += 1
                code = exc.code() if isinstance(exc, grpc.RpcError) else "stream closed"
                log.warning("rollout stream to ingest failed (%s); retrying in %.1fs with %s group in hand", code,
                            delay, "a" if current is not None else "no")
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
