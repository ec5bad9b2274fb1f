"""The slices of a weight version held by the trainer, as a sampler's fetch asks for them: the request checked
against the held version (refused with the status a fetch gets, over gRPC and the TCP data plane alike), and the
bytes sent at most at weights.max_serve_mb_s."""

from __future__ import annotations

import time
from typing import Iterator

import grpc
import numpy as np

from grpo_stream.common.registry.transports import transport_spec
from grpo_stream.common.weights.snapshot import WeightSnapshot, WeightTransferError, box_from_proto, stream_box
from grpo_stream.protos import weights_pb2
from grpo_stream.trainer_service.publication.publisher import WeightPublisher

# A sampler asks for each tensor's slices its devices hold (devices x a multi-host trainer's processes): thousands for
# the largest models. The byte check below does not bound the count (each slice may be one element), and every slice
# costs a plan entry and a chunk with its framing: a 64 MiB request of one-element slices held a trainer thread on
# millions of them. The data plane's 1 MiB request limit (tcp_wire.MAX_REQUEST_BYTES) allows about as many as this.
MAX_SLICES_PER_FETCH = 1 << 17


class Plan(list):
    """(tensor index, slice index, host array, box) per requested slice, and the snapshot they come from: held as
    long as the plan is, so that the publisher serves that version to the fetch's other lanes until it ends."""

    def __init__(self, snapshot: WeightSnapshot):
        super().__init__()
        self.snapshot = snapshot


class FetchRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class SliceServer:
    """Serves the slices of the versions `publisher` holds; `max_serve_mb_s` caps each fetch's bytes per second (None:
    no cap)."""

    def __init__(self, publisher: WeightPublisher, max_serve_mb_s: float | None = None):
        self.publisher, self.max_serve_mb_s = publisher, max_serve_mb_s

    def plan(self, request: weights_pb2.FetchSlicesRequest) -> Plan:
        """Each requested slice of the version held now; raises FetchRefused with the status a fetch gets."""
        snapshot = self.publisher.held(request.version)
        transport = self.publisher.transport
        if not transport_spec(transport).trainer_serves:
            raise FetchRefused(grpc.StatusCode.FAILED_PRECONDITION,
                               f"weights.transport={transport}: the trainer does not serve version bytes; "
                               "samplers read them through that transport")
        if snapshot is None or snapshot.version != request.version or (
                request.trainer_epoch and request.trainer_epoch != snapshot.epoch):
            raise FetchRefused(grpc.StatusCode.NOT_FOUND,
                               f"version {request.version} is not held (latest: "
                               f"{None if snapshot is None else snapshot.version}); ask for the manifest again")
        asked_slices = sum(len(tensor.slices) for tensor in request.tensors)
        if asked_slices > MAX_SLICES_PER_FETCH:
            raise FetchRefused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"tensors.slices: {asked_slices} slices in one fetch, more than {MAX_SLICES_PER_FETCH}; "
                               "ask for each device's slice of a tensor once, over several fetches if need be")
        arrays = list(snapshot.arrays.values())
        plan = Plan(snapshot)
        try:
            for tensor in request.tensors:
                if not 0 <= tensor.tensor_index < len(arrays):
                    raise WeightTransferError(f"tensors.tensor_index={tensor.tensor_index} outside the manifest's "
                                              f"{len(arrays)} tensors")
                arr = arrays[tensor.tensor_index]
                for k, rng in enumerate(tensor.slices):
                    box = box_from_proto(rng, arr.shape, f"tensor {tensor.tensor_index} slice {k}")
                    if hasattr(arr, "holds") and not arr.holds(box):  # a multi-host trainer's share (HeldBoxes)
                        raise WeightTransferError(f"tensor {tensor.tensor_index} slice {k}: not served by this "
                                                  "trainer process; ask the host the manifest's sources name")
                    plan.append((tensor.tensor_index, k, arr, box))
            asked = sum(int(np.prod([b.stop - b.start for b in box])) * arr.itemsize for _, _, arr, box in plan)
            held = sum(a.nbytes for a in arrays)
            if asked > held:  # each device's slices are disjoint: more than the version means repeats
                raise WeightTransferError(f"tensors: {asked} bytes of slices requested, more than the whole "
                                          f"version ({held} bytes); ask for each slice once")
        except WeightTransferError as exc:
            raise FetchRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return plan

    def pace(self, sent: int, start: float) -> None:
        """Sleep so that a fetch that has sent `sent` bytes since `start` stays within weights.max_serve_mb_s."""
        if self.max_serve_mb_s is not None:
            ahead = sent / (self.max_serve_mb_s * 1e6) - (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead)

    def chunks(self, plan: Plan) -> Iterator[weights_pb2.SliceChunk]:
        """The planned slices as FetchSlices' chunks (chunked and checksummed), paced."""
        sent, start = 0, time.monotonic()
        for t, k, arr, box in plan:
            for chunk in stream_box(arr, box, t, k, self.publisher.chunk_bytes):
                self.pace(sent, start)
                sent += len(chunk.data)
                yield chunk
