"""The `local` weight transport: trainer and samplers in one JAX process (single controller).

The trainer publishes its device arrays (immutable: a later step makes new
ones, so a published version never changes under a reader); a sampler
installs a version with one `jax.device_put` onto its own mesh, which is a
device-to-device copy (or, under Pathways on TPU, a transfer between
slices). Nothing is copied through the host.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import jax
import numpy as np

from grpo_stream.common.weights.snapshot import BASE_VERSION, WeightTransferError, manifest_of
from grpo_stream.common.weights.transport import SinkContext, SourceContext
from grpo_stream.protos import weights_pb2


@dataclasses.dataclass(frozen=True)
class LocalVersion:
    version: int
    named: dict[str, jax.Array]
    final: bool
    epoch: str
    published_unix: float
    adapters: weights_pb2.AdapterVersion | None = None  # LoRA: how these adapters merge into the base


class LocalWeightHub:
    """The newest published version, shared by the trainer thread and sampler threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: LocalVersion | None = None
        self._base: LocalVersion | None = None  # LoRA: the frozen base beside the adapters-only versions

    def publish(self, version: int, named: dict[str, jax.Array], final: bool, epoch: str,
                adapters: weights_pb2.AdapterVersion | None = None) -> LocalVersion:
        entry = LocalVersion(version, dict(named), final, epoch, time.time(), adapters)
        with self._lock:
            if version == BASE_VERSION:
                self._base = entry
            else:
                self._latest = entry
        return entry

    def base(self) -> LocalVersion | None:
        with self._lock:
            return self._base

    def latest(self) -> LocalVersion | None:
        with self._lock:
            return self._latest

    @staticmethod
    def install(entry: LocalVersion, targets: dict[str, Any]) -> dict[str, jax.Array]:
        """`entry`'s arrays placed with each target's sharding and dtype (ShapeDtypeStructs with sharding)."""
        out = {}
        for name, target in targets.items():
            arr = entry.named[name]
            if arr.dtype != target.dtype:
                arr = arr.astype(target.dtype)
            out[name] = jax.device_put(arr, target.sharding)
        return out


def _with_adapters(manifest: weights_pb2.WeightManifest, adapters) -> weights_pb2.WeightManifest:
    if adapters is not None:
        manifest.adapters.CopyFrom(adapters)
    return manifest


def _hub(ctx) -> LocalWeightHub:
    if ctx.hub is None:
        raise ValueError("weights.transport=local runs the samplers inside the trainer's process: start the run with "
                         "`grpo-stream up` (or `grpo-stream colocated`), or choose another weights.transport")
    return ctx.hub


class LocalSink:
    def __init__(self, hub: LocalWeightHub):
        self.hub = hub

    def put(self, version, named, final, epoch, now, *, adapters=None):
        specs = {n: (tuple(a.shape), np.dtype(a.dtype)) for n, a in named.items()}
        self.hub.publish(version, named, final, epoch, adapters)
        return _with_adapters(manifest_of(version, specs, final, epoch, now, 0, "local"), adapters), None


def make_sink(ctx: SinkContext) -> LocalSink:
    return LocalSink(_hub(ctx))


def make_source(ctx: SourceContext) -> "LocalFetcher":
    return LocalFetcher(_hub(ctx))


class LocalFetcher:
    def __init__(self, hub: LocalWeightHub):
        self.hub = hub
        self._entry = None

    def latest(self, installed_version: int) -> weights_pb2.WeightManifest | None:
        entry = self._entry = self.hub.latest()
        if entry is None:
            return None
        specs = {n: (tuple(a.shape), np.dtype(a.dtype)) for n, a in entry.named.items()}
        return _with_adapters(manifest_of(entry.version, specs, entry.final, entry.epoch, entry.published_unix, 0,
                                          "local"), entry.adapters)

    def fetch(self, manifest: weights_pb2.WeightManifest, targets: dict[str, jax.ShapeDtypeStruct]) -> dict:
        entry = self.hub.base() if manifest.version == BASE_VERSION else self._entry
        if entry is None or entry.version != manifest.version or entry.epoch != manifest.trainer_epoch:
            raise WeightTransferError(f"version {manifest.version} was replaced while installing; poll again")
        return LocalWeightHub.install(entry, targets)
