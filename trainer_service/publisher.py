"""Weight publication: one publisher over any transport's sink, one WeightService for manifests and lag reports.

`publish` runs on the trainer's publication thread, never on the step loop:
it casts to the wire dtype on device, then hands the arrays to the transport's
sink (common/weights/registry.py): the grpc sink keeps a host snapshot that
FetchSlices streams from (fetches already streaming keep reading the snapshot
they started with), the checkpoint sink saves with Orbax, the local one hands
device arrays to the in-process hub. Only then does the manifest switch, so a sampler never sees a version that
is not fully readable. Each sampler reports the version it runs; the
publisher keeps that history for the lag metric and the run summary.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import grpc
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.config.schema import WeightsSection
from grpo_stream.common.weights.registry import transport_spec, weight_sink
from grpo_stream.common.weights.snapshot import (DEFAULT_CHUNK_BYTES, WeightSnapshot, WeightTransferError,
                                                 box_from_proto, new_epoch, stream_box)
from grpo_stream.common.weights.transport import SinkContext, WeightSink
from grpo_stream.protos import weights_pb2, weights_pb2_grpc


class FetchRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclasses.dataclass
class PublishStats:
    version: int
    seconds: float  # publication thread: cast + copy/save until the manifest switched
    nbytes: int


class WeightPublisher(weights_pb2_grpc.WeightServiceServicer):
    def __init__(self, sink: WeightSink | None = None, transport: str | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_serve_mb_s: float | None = None,
                 wire_dtype: str = "model", epoch: str | None = None):
        """`sink`: where versions go (registry.weight_sink), made for weights.transport `transport`; None: the
        default transport's, with `chunk_bytes`."""
        if sink is None:
            weights = WeightsSection.model_construct(chunk_bytes=chunk_bytes)  # tests use chunks below its limit
            transport, sink = weights.transport, weight_sink(weights.transport, SinkContext(weights))
        elif transport is None:
            raise TypeError("WeightPublisher(sink=...) needs the transport's name too")
        self.sink, self.transport = sink, transport
        self.chunk_bytes, self.max_serve_mb_s, self.wire_dtype = chunk_bytes, max_serve_mb_s, wire_dtype
        self.epoch = epoch or new_epoch()
        self.data_port = 0  # set by a WeightDataServer serving this publisher's snapshots
        self._lock = threading.Lock()
        self._snapshot: WeightSnapshot | None = None
        self._manifest: weights_pb2.WeightManifest | None = None
        self.published: list[int] = []
        self.publish_seconds: list[float] = []
        self.installed: dict[str, list[int]] = {}
        self.fetch_failures: dict[str, int] = {}
        self.last_seen: dict[str, float] = {}
        self.throughput: dict[str, tuple[float, float]] = {}  # sampler -> (groups/s, tokens/s) it last reported

    # -- publishing -------------------------------------------------------------------------------------------
    def publish_arrays(self, version: int, named: dict[str, Any], final: bool = False) -> PublishStats:
        """Publish device (or host) arrays `named` as `version` over the configured transport."""
        start = time.monotonic()
        self._check_newer(version, final)
        if self.wire_dtype != "model":
            dtype = jnp.dtype(self.wire_dtype)
            named = {n: a.astype(dtype) if a.dtype != dtype else a for n, a in named.items()}
        manifest, snapshot = self.sink.put(version, named, final, self.epoch, time.time())
        self._switch(manifest, snapshot)
        seconds = time.monotonic() - start
        self.publish_seconds.append(seconds)
        return PublishStats(version, seconds, manifest.total_bytes)

    def publish(self, snapshot: WeightSnapshot) -> None:
        """Publish a prepared host snapshot (a transport whose bytes the trainer serves)."""
        self._check_newer(snapshot.version, snapshot.final)
        if not snapshot.epoch:
            snapshot = dataclasses.replace(snapshot, epoch=self.epoch)
        self._switch(snapshot.manifest(self.chunk_bytes, "grpc"), snapshot)

    def _check_newer(self, version: int, final: bool) -> None:
        with self._lock:
            current = None if self._manifest is None else self._manifest.version
        if current is not None and version <= current and not (final and version == current):
            raise ValueError(f"version {version} is not newer than {current}")

    def _switch(self, manifest: weights_pb2.WeightManifest, snapshot: WeightSnapshot | None) -> None:
        if snapshot is not None:
            manifest.data_port = self.data_port
        with self._lock:
            self._snapshot, self._manifest = snapshot, manifest
            if not self.published or self.published[-1] != manifest.version:
                self.published.append(manifest.version)

    @property
    def latest_version(self) -> int | None:
        with self._lock:
            return None if self._manifest is None else self._manifest.version

    def samplers_at(self, version: int) -> dict[str, bool]:
        with self._lock:
            return {sid: bool(v) and v[-1] >= version for sid, v in self.installed.items()}

    def record(self, sampler_id: str, installed_version: int, failures: int = 0, epoch: str = "",
               throughput: tuple[float, float] | None = None) -> None:
        """Note a sampler's installed version (versions of another trainer epoch are not ours to count)."""
        if not sampler_id or (epoch and epoch != self.epoch):
            return
        with self._lock:
            history = self.installed.setdefault(sampler_id, [])
            if installed_version >= 0 and (not history or history[-1] != installed_version):
                history.append(installed_version)
            self.fetch_failures[sampler_id] = failures
            self.last_seen[sampler_id] = time.time()
            if throughput is not None:
                self.throughput[sampler_id] = throughput

    def sampler_status(self) -> list[dict]:
        """Each sampler's installed version, lag behind the latest publication, throughput and last report."""
        latest = self.latest_version
        with self._lock:
            return [{"sampler_id": sid, "installed_version": v[-1] if v else -1,
                     "lag": (latest - v[-1]) if (v and latest is not None) else 0,
                     "groups_per_s": self.throughput.get(sid, (0.0, 0.0))[0],
                     "tokens_per_s": self.throughput.get(sid, (0.0, 0.0))[1],
                     "last_seen_unix": self.last_seen.get(sid, 0.0), "fetch_failures": self.fetch_failures.get(sid, 0)}
                    for sid, v in sorted(self.installed.items())]

    # -- WeightService ----------------------------------------------------------------------------------------
    def GetManifest(self, request, context):
        with self._lock:
            manifest = self._manifest
        # the manifest request does not carry the caller's epoch: count it only if it matches ours
        if manifest is not None and request.installed_version <= manifest.version:
            self.record(request.sampler_id, request.installed_version)
        if manifest is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no weights published yet; retry shortly")
        return manifest

    def ReportVersion(self, request, context):
        self.record(request.sampler_id, request.installed_version, request.fetch_failures, request.trainer_epoch,
                    (request.groups_per_s, request.tokens_per_s))
        latest = self.latest_version
        return weights_pb2.VersionReportReply(latest_version=-1 if latest is None else latest)

    def plan(self, request: weights_pb2.FetchSlicesRequest) -> list[tuple[int, int, np.ndarray, tuple]]:
        """(tensor index, slice index, host array, box) per requested slice of the version held now; raises
        FetchRefused with the status a fetch gets (gRPC and the TCP data plane answer alike)."""
        with self._lock:
            snapshot = self._snapshot
        if not transport_spec(self.transport).trainer_serves:
            raise FetchRefused(grpc.StatusCode.FAILED_PRECONDITION,
                               f"weights.transport={self.transport}: the trainer does not serve version bytes; "
                               "samplers read them through that transport")
        if snapshot is None or snapshot.version != request.version or (
                request.trainer_epoch and request.trainer_epoch != snapshot.epoch):
            raise FetchRefused(grpc.StatusCode.NOT_FOUND,
                               f"version {request.version} is not held (latest: "
                               f"{None if snapshot is None else snapshot.version}); ask for the manifest again")
        arrays = list(snapshot.arrays.values())
        plan = []
        try:
            for tensor in request.tensors:
                if not 0 <= tensor.tensor_index < len(arrays):
                    raise WeightTransferError(f"tensors.tensor_index={tensor.tensor_index} outside the manifest's "
                                              f"{len(arrays)} tensors")
                arr = arrays[tensor.tensor_index]
                for k, rng in enumerate(tensor.slices):
                    plan.append((tensor.tensor_index, k, arr, box_from_proto(rng, arr.shape, f"tensor "
                                                                             f"{tensor.tensor_index} slice {k}")))
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

    def FetchSlices(self, request, context):
        try:
            plan = self.plan(request)
        except FetchRefused as exc:
            context.abort(exc.code, exc.message)
        sent, start = 0, time.monotonic()
        for t, k, arr, box in plan:
            for chunk in stream_box(arr, box, t, k, self.chunk_bytes):
                self.pace(sent, start)
                sent += len(chunk.data)
                yield chunk
