"""Weight publication over gRPC: the trainer serves its latest published version.

`publish` swaps in a new immutable host snapshot; fetches already streaming
keep reading the snapshot they started with, so a sampler always receives
one whole version. Each sampler reports its installed version when it asks
for the manifest; the publisher keeps that history (for the run summary
and the weight-lag metric).
"""

from __future__ import annotations

import threading
import time

import grpc

from common.weights import DEFAULT_CHUNK_BYTES, WeightSnapshot
from protos import weights_pb2, weights_pb2_grpc


class WeightPublisher(weights_pb2_grpc.WeightServiceServicer):
    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self._snapshot: WeightSnapshot | None = None
        self._manifest: weights_pb2.WeightManifest | None = None
        self.published: list[int] = []
        self.installed: dict[str, list[int]] = {}
        self.last_seen: dict[str, float] = {}

    def publish(self, snapshot: WeightSnapshot) -> None:
        manifest = snapshot.manifest(self.chunk_bytes)
        with self._lock:
            if self._snapshot is not None and snapshot.version <= self._snapshot.version and not snapshot.final:
                raise ValueError(f"version {snapshot.version} is not newer than {self._snapshot.version}")
            self._snapshot, self._manifest = snapshot, manifest
            if not self.published or self.published[-1] != snapshot.version:
                self.published.append(snapshot.version)

    @property
    def latest_version(self) -> int | None:
        with self._lock:
            return None if self._snapshot is None else self._snapshot.version

    def samplers_at(self, version: int) -> dict[str, bool]:
        with self._lock:
            return {sid: bool(v) and v[-1] >= version for sid, v in self.installed.items()}

    def _record(self, sampler_id: str, installed_version: int) -> None:
        if not sampler_id:
            return
        with self._lock:
            history = self.installed.setdefault(sampler_id, [])
            if installed_version >= 0 and (not history or history[-1] != installed_version):
                history.append(installed_version)
            self.last_seen[sampler_id] = time.time()

    def GetManifest(self, request, context):
        self._record(request.sampler_id, request.installed_version)
        with self._lock:
            manifest = self._manifest
        if manifest is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no weights published yet; retry shortly")
        return manifest

    def FetchWeights(self, request, context):
        with self._lock:
            snapshot = self._snapshot
        if snapshot is None or snapshot.version != request.version:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"version {request.version} is not held (latest: "
                          f"{None if snapshot is None else snapshot.version}); ask for the manifest again")
        yield from snapshot.chunks(self.chunk_bytes)
