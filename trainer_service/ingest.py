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

from common.buffer import BufferUnavailable, Incoming, RedisStreamBuffer
from common.wire import GroupLimits, validate_group
from protos import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_STAT = {0: "accepted", _INVALID: "invalid", _EXHAUSTED: "full", _UNAVAILABLE: "unavailable"}


class IngestServicer(rollout_pb2_grpc.RolloutIngestServicer):
    def __init__(self, buffer: RedisStreamBuffer, limits: GroupLimits, max_groups: int, retry_after_ms: int):
        self.buffer, self.limits = buffer, limits
        self.max_groups, self.retry_after_ms = max_groups, retry_after_ms
        self._lock = threading.Lock()
        self.stats = {"accepted": 0, "duplicate": 0, "invalid": 0, "full": 0, "unavailable": 0}

    def handle_batch(self, groups) -> list[rollout_pb2.GroupAck]:
        """Validate every group, append the valid ones in one buffer call; one ack per group, in order.

        A group id the buffer accepted before is acknowledged OK again ("duplicate") without a second copy: its
        sender lost the first acknowledgement (a dropped stream, an ingest restart) and must not keep it."""
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
        statuses, depth = [], 0
        try:
            statuses, depth = self.buffer.append_many(
                [Incoming(g.group_id, g.sampler_id, g.policy_version, g.data_position if g.HasField("data_position")
                          else -1, g.SerializeToString()) for _, g in valid], self.max_groups,
                refused_invalid=len(groups) - len(valid))
        except BufferUnavailable as exc:
            log.error("buffer unavailable: %s", exc)
            for slot, g in valid:
                acks[slot] = rollout_pb2.GroupAck(
                    group_id=g.group_id, code=_UNAVAILABLE, retry_after_ms=1000,
                    message=f"rollout buffer unavailable ({exc}); retry with backoff")
        duplicates = 0
        for (slot, g), status in zip(valid, statuses):
            if status == "full":
                acks[slot] = rollout_pb2.GroupAck(
                    group_id=g.group_id, code=_EXHAUSTED, retry_after_ms=self.retry_after_ms,
                    buffer_depth=depth, message=f"{depth} groups wait for the trainer (buffer.max_groups="
                                                f"{self.max_groups}); retry after {self.retry_after_ms} ms")
            else:
                duplicates += status == "dup"
                acks[slot] = rollout_pb2.GroupAck(group_id=g.group_id, code=0, buffer_depth=depth,
                                                  message="duplicate: accepted before" if status == "dup" else "")
        with self._lock:
            for ack in acks:
                self.stats[_STAT[ack.code]] += 1
            self.stats["accepted"] -= duplicates
            self.stats["duplicate"] += duplicates
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

    def GetDataPosition(self, request, context):
        if not request.sampler_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampler_id: must not be empty")
        try:
            position = self.buffer.data_position(request.sampler_id)
        except BufferUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"rollout buffer unavailable ({exc}); retry with backoff")
        return rollout_pb2.DataPosition(known=position is not None, position=position or 0)
