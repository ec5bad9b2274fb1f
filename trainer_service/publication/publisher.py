"""Weight publication: versions made available over any transport's sink, the manifest switched to each only once
it is fully readable.

`publish_arrays` runs on the trainer's publication thread, never on the step loop:
it casts to the wire dtype on device, then hands the arrays to the transport's
sink (common/weights/registry.py): the grpc sink keeps a host snapshot that
FetchSlices streams from (fetches already streaming keep reading the snapshot
they started with), the checkpoint sink saves with Orbax, the local one hands
device arrays to the in-process hub. Only then does the manifest switch, so a sampler never sees a version that
is not fully readable.

The version replaced stays servable for as long as a fetch still streams it, and not a moment longer (the publisher
keeps only a weak reference; each fetch's plan holds its snapshot): a sampler's fetch runs several lanes, each its
own request, and a lane that asked after the switch found the version gone (NOT_FOUND) while its sibling lanes still
streamed it, which failed the whole fetch and cost the sampler a back-off. No host copy is kept for this that a
fetch in flight would not have held anyway.

The publisher only holds versions. Serving them is the WeightService's (weight_service.py: manifests, and for the
grpc transport the slices, grpc_transport_server/); what samplers report goes to the registry the publisher owns
(`samplers`, samplers.py), which the services that report on samplers reach where they reach the versions.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Any, Callable

import jax.numpy as jnp

from grpo_stream.common.config.schema import WeightsSection
from grpo_stream.common.weights.registry import weight_sink
from grpo_stream.common.weights.snapshot import BASE_VERSION, DEFAULT_CHUNK_BYTES, WeightSnapshot, new_epoch
from grpo_stream.common.weights.transport import SinkContext, WeightSink
from grpo_stream.protos import weights_pb2
from grpo_stream.trainer_service.publication.samplers import SamplerRegistry


@dataclasses.dataclass
class PublishStats:
    version: int
    seconds: float  # publication thread: cast + copy/save until the manifest switched
    nbytes: int


class WeightPublisher:
    """Numbers versions, puts each into the transport's sink and switches the manifest to it; holds the latest
    version (and, with LoRA, the epoch's frozen base) for the servers that serve them."""

    def __init__(self, sink: WeightSink | None = None, transport: str | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, wire_dtype: str = "model", epoch: str | None = None):
        """`sink`: where versions go (registry.weight_sink), made for weights.transport `transport`; None: the
        default transport's, with `chunk_bytes`."""
        if sink is None:
            weights = WeightsSection.model_construct(chunk_bytes=chunk_bytes)  # tests use chunks below its limit
            transport, sink = weights.transport, weight_sink(weights.transport, SinkContext(weights))
        elif transport is None:
            raise TypeError("WeightPublisher(sink=...) needs the transport's name too")
        self.sink, self.transport = sink, transport
        self.chunk_bytes, self.wire_dtype = chunk_bytes, wire_dtype
        self.epoch = epoch or new_epoch()
        self.data_port = 0  # set by a WeightDataServer serving this publisher's snapshots; manifests announce it
        # multi-host trainer, process 0: called with each new manifest before it is served; waits until every
        # process serves its slices of that version and lists them in `manifest.hosts` (trainer_service/multihost.py)
        self.gather_hosts: Callable[[weights_pb2.WeightManifest], None] | None = None
        self.samplers = SamplerRegistry()  # the samplers that install this publisher's versions
        self._lock = threading.Lock()
        self._snapshot: WeightSnapshot | None = None
        self._manifest: weights_pb2.WeightManifest | None = None
        # multi-host: the version this process announced it serves (gather_hosts), served beside the one held until
        # the switch, so that a sampler sent here by process 0's manifest finds it
        self._incoming: WeightSnapshot | None = None
        # the version the last switch replaced, alive only while a fetch in flight holds it (module docstring)
        self._previous: weakref.ref[WeightSnapshot] | None = None
        # LoRA: the frozen base (version BASE_VERSION of this epoch), published once and served beside the latest
        self._base_snapshot: WeightSnapshot | None = None
        self._base_manifest: weights_pb2.WeightManifest | None = None
        self.published: list[int] = []
        self.publish_seconds: list[float] = []

    def publish_arrays(self, version: int, named: dict[str, Any], final: bool = False,
                       adapters: weights_pb2.AdapterVersion | None = None) -> PublishStats:
        """Publish device (or host) arrays `named` as `version` over the configured transport. With `adapters`
        (LoRA), `named` holds the adapters only and the manifest tells samplers how to merge them into the base
        that `publish_base` made available."""
        start = time.monotonic()
        self._check_newer(version, final)
        if adapters is not None and self._base_manifest is None:
            raise ValueError("an adapters-only version needs the base published first (publish_base)")
        if adapters is None:
            manifest, snapshot = self.sink.put(version, self._wire(named), final, self.epoch, time.time())
        else:
            adapters = weights_pb2.AdapterVersion(base=self._base_manifest, merges=adapters.merges,
                                                  scale=adapters.scale)
            manifest, snapshot = self.sink.put(version, self._wire(named), final, self.epoch, time.time(),
                                               adapters=adapters)
        self._switch(manifest, snapshot)
        seconds = time.monotonic() - start
        self.publish_seconds.append(seconds)
        return PublishStats(version, seconds, manifest.total_bytes)

    def publish_base(self, named: dict[str, Any]) -> PublishStats:
        """LoRA: make the frozen base weights `named` (the plain model's names) available as version BASE_VERSION of
        this epoch, for the adapters-only versions after it; once per trainer process, before those versions."""
        start = time.monotonic()
        manifest, snapshot = self.sink.put(BASE_VERSION, self._wire(named), False, self.epoch, time.time())
        if snapshot is not None:
            manifest.data_port = self.data_port
        with self._lock:
            self._base_snapshot, self._base_manifest = snapshot, manifest
        return PublishStats(BASE_VERSION, time.monotonic() - start, manifest.total_bytes)

    def _wire(self, named: dict[str, Any]) -> dict[str, Any]:
        """`named` cast to weights.wire_dtype (on device, before the transport copies it)."""
        if self.wire_dtype == "model":
            return named
        dtype = jnp.dtype(self.wire_dtype)
        return {n: a.astype(dtype) if a.dtype != dtype else a for n, a in named.items()}

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
        if self.gather_hosts is not None:
            with self._lock:  # servable before it is announced: process 0 may list this process at once
                self._incoming = snapshot
            try:
                self.gather_hosts(manifest)
            except BaseException:
                with self._lock:
                    self._incoming = None
                raise
        with self._lock:
            old = self._snapshot
            if old is not None and (snapshot is None or old.version != snapshot.version):
                self._previous = weakref.ref(old)
            self._snapshot, self._manifest, self._incoming = snapshot, manifest, None
            if not self.published or self.published[-1] != manifest.version:
                self.published.append(manifest.version)

    @property
    def latest_version(self) -> int | None:
        with self._lock:
            return None if self._manifest is None else self._manifest.version

    @property
    def manifest(self) -> weights_pb2.WeightManifest | None:
        """The manifest of the latest version (None before the first publication)."""
        with self._lock:
            return self._manifest

    def held(self, version: int) -> WeightSnapshot | None:
        """The host snapshot a fetch of `version` reads: the epoch's base for BASE_VERSION, the version a multi-host
        trainer's process announced and has not switched to yet, the version replaced last while a fetch still
        streams it, else the latest (None: nothing held; a transport whose bytes the trainer does not serve holds
        none). The caller checks the version it got."""
        with self._lock:
            if version == BASE_VERSION:
                return self._base_snapshot
            if self._incoming is not None and self._incoming.version == version:
                return self._incoming
            previous = self._previous() if self._previous is not None else None
            if previous is not None and previous.version == version and (
                    self._snapshot is None or self._snapshot.version != version):
                return previous
            return self._snapshot
