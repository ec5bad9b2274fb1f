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


@dataclasses.dataclass(frozen=True)
class LocalVersion:
    version: int
    named: dict[str, jax.Array]
    final: bool
    epoch: str
    published_unix: float


class LocalWeightHub:
    """The newest published version, shared by the trainer thread and sampler threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._latest: LocalVersion | None = None

    def publish(self, version: int, named: dict[str, jax.Array], final: bool, epoch: str) -> LocalVersion:
        entry = LocalVersion(version, dict(named), final, epoch, time.time())
        with self._lock:
            self._latest = entry
        return entry

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
