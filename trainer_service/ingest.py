"""The ingest: a gRPC service that validates rollout groups and appends them to the buffer.

Flow control: when the buffer holds `buffer.max_groups` groups the ingest
answers RESOURCE_EXHAUSTED with a retry hint and the producer keeps the
group and sends it again later, so nothing is dropped. A bad group is
refused with INVALID_ARGUMENT naming the field; the service stays up.
"""

from __future__ import annotations

import logging
import threading

import grpc

from common.buffer import BufferUnavailable, RolloutBuffer
from common.wire import GroupLimits, validate_group
from protos import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_STAT = {0: "accepted", _INVALID: "invalid", _EXHAUSTED: "full", _UNAVAILABLE: "unavailable"}


class IngestServicer(rollout_pb2_grpc.RolloutIngestServicer):
    def __init__(self, buffer: RolloutBuffer, limits: GroupLimits, max_groups: int, retry_after_ms: int):
        self.buffer, self.limits = buffer, limits
        self.max_groups, self.retry_after_ms = max_groups, retry_after_ms
        self._lock = threading.Lock()
        self.stats = {"accepted": 0, "invalid": 0, "full": 0, "unavailable": 0}

    def handle_batch(self, groups) -> list[rollout_pb2.GroupAck]:
        """Validate every group, append the valid ones in one buffer write; one ack per group, in order."""
        acks: list[rollout_pb2.GroupAck | None] = []
        valid: list[tuple[int, rollout_pb2.RolloutGroup]] = []
        for group in groups:
            errors = validate_group(group, self.limits)
            if errors:
                message = "; ".join(errors)
                log.warning("rejected group %r from %r: %s", group.group_id, group.sampler_id, message)
                acks.append(rollout_pb2.GroupAck(group_id=group.group_id, code=_INVALID, message=message))
            else:
                valid.append((len(acks), group))
                acks.append(None)
        appended, depth = 0, 0
        if valid:
            try:
                appended, depth = self.buffer.append_many(
                    [(g.SerializeToString(), g.sampler_id) for _, g in valid], self.max_groups)
            except BufferUnavailable as exc:
                log.error("buffer unavailable: %s", exc)
                for slot, g in valid:
                    acks[slot] = rollout_pb2.GroupAck(
                        group_id=g.group_id, code=_UNAVAILABLE, retry_after_ms=1000,
                        message=f"rollout buffer unavailable ({exc}); retry with backoff")
        for k, (slot, g) in enumerate(valid):
            if acks[slot] is not None:
                continue
            if k < appended:
                acks[slot] = rollout_pb2.GroupAck(group_id=g.group_id, code=0, buffer_depth=depth)
            else:
                acks[slot] = rollout_pb2.GroupAck(
                    group_id=g.group_id, code=_EXHAUSTED, retry_after_ms=self.retry_after_ms,
                    buffer_depth=depth, message=f"buffer holds {depth} groups (buffer.max_groups="
                                                f"{self.max_groups}); retry after {self.retry_after_ms} ms")
        with self._lock:
            for ack in acks:
                self.stats[_STAT[ack.code]] += 1
        return acks

    def StreamBatches(self, request_iterator, context):
        for batch in request_iterator:
            yield rollout_pb2.BatchAck(acks=self.handle_batch(batch.groups))

    def PushGroup(self, request, context):
        ack = self.handle_batch([request])[0]
        if ack.code:
            code = next(c for c in grpc.StatusCode if c.value[0] == ack.code)
            if ack.retry_after_ms:
                context.set_trailing_metadata((("retry-after-ms", str(ack.retry_after_ms)),))
            context.abort(code, ack.message)
        return ack
