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

from common.buffer import BufferFull, BufferUnavailable, RolloutBuffer
from common.wire import GroupLimits, validate_group
from protos import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


class IngestServicer(rollout_pb2_grpc.RolloutIngestServicer):
    def __init__(self, buffer: RolloutBuffer, limits: GroupLimits, max_groups: int, retry_after_ms: int):
        self.buffer, self.limits = buffer, limits
        self.max_groups, self.retry_after_ms = max_groups, retry_after_ms
        self._lock = threading.Lock()
        self.stats = {"accepted": 0, "invalid": 0, "full": 0, "unavailable": 0}

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def handle(self, group: rollout_pb2.RolloutGroup) -> rollout_pb2.GroupAck:
        errors = validate_group(group, self.limits)
        if errors:
            self._count("invalid")
            message = "; ".join(errors)
            log.warning("rejected group %r from %r: %s", group.group_id, group.sampler_id, message)
            return rollout_pb2.GroupAck(group_id=group.group_id, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                        message=message)
        try:
            depth = self.buffer.append(group.SerializeToString(), group.sampler_id, self.max_groups)
        except BufferFull as exc:
            self._count("full")
            return rollout_pb2.GroupAck(group_id=group.group_id, code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                        message=f"{exc}; retry after {self.retry_after_ms} ms",
                                        retry_after_ms=self.retry_after_ms, buffer_depth=self.max_groups)
        except BufferUnavailable as exc:
            self._count("unavailable")
            log.error("buffer unavailable: %s", exc)
            return rollout_pb2.GroupAck(group_id=group.group_id, code=grpc.StatusCode.UNAVAILABLE.value[0],
                                        message=f"rollout buffer unavailable ({exc}); retry with backoff",
                                        retry_after_ms=1000)
        self._count("accepted")
        return rollout_pb2.GroupAck(group_id=group.group_id, code=0, buffer_depth=depth)

    def StreamGroups(self, request_iterator, context):
        for group in request_iterator:
            yield self.handle(group)

    def PushGroup(self, request, context):
        ack = self.handle(request)
        if ack.code:
            code = next(c for c in grpc.StatusCode if c.value[0] == ack.code)
            if ack.retry_after_ms:
                context.set_trailing_metadata((("retry-after-ms", str(ack.retry_after_ms)),))
            context.abort(code, ack.message)
        return ack
