"""The grpc sink's host copy of a published version: asynchronous copies into host buffers reused across versions.

The trainer serves every version of the grpc transport from host memory. `jax.device_get` would allocate fresh host
arrays for each version (every page faulted in again) and, on GPU, copy into pageable memory, which the driver
bounces through a staging buffer. Here every transfer is started before any is waited on (on an accelerator with
pinned host memory, `jax.device_put` to a `pinned_host` sharding: a DMA straight to page-locked memory; otherwise
`copy_to_host_async`), so the copies overlap each other and the gathering; each array is then gathered into a host
buffer kept from an earlier version (`ReceiveBuffers`: 64-byte aligned, handed out again only while nothing else
references it). A snapshot that is still served, or that a fetch in flight still streams, holds its buffers, so
it is never overwritten: the publisher replaces its snapshot only after the next one is whole, so two sets of
buffers take turns, and a third appears only while a slow fetch still reads an old version.

On CPU the device buffers are host memory already and `np.asarray` views them without copying: buffers there would
add the one copy that path avoids, so CPU keeps the plain path unless a caller asks for buffers (tests do).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import numpy as np

from grpo_stream.common.model.sharding import normalized
from grpo_stream.common.weights.receive_buffers import ReceiveBuffers
from grpo_stream.common.weights.snapshot import box_key

log = logging.getLogger(__name__)
PINNED = "pinned_host"

Shards = list[tuple[tuple, jax.Array]]  # (index into the whole array, the single-device array holding it)


def _platform(arr: jax.Array) -> str:
    return next(iter(arr.sharding.device_set)).platform


def offers_pinned(arr: jax.Array) -> bool:
    """Whether the devices of `arr` have a pinned host memory that JAX can place arrays in."""
    device = next(iter(arr.sharding.device_set))
    return any(memory.kind == PINNED for memory in device.addressable_memories())


def distinct_shards(arr: jax.Array) -> Shards:
    """One addressable shard per distinct box of `arr` (a replicated box is copied once, not once per device)."""
    seen, out = set(), []
    for shard in arr.addressable_shards:
        key = box_key(normalized(shard.index, arr.shape))
        if key not in seen:
            seen.add(key)
            out.append((shard.index, shard.data))
    return out


class HostStaging:
    """Device arrays -> host arrays for the grpc sink's snapshots. `pooled`: gather into reused host buffers (None:
    on accelerators, not on CPU); `pinned`: copy through pinned host memory (None: where the devices offer it and
    are not the CPU); `keep`: buffer sets kept per tensor (more are made while all are referenced)."""

    def __init__(self, keep: int = 2, pooled: bool | None = None, pinned: bool | None = None):
        self.buffers = ReceiveBuffers(keep)
        self.pooled, self.pinned = pooled, pinned

    def to_host(self, named: dict[str, Any]) -> dict[str, np.ndarray]:
        """`named` as host arrays (host arrays given are kept as they are)."""
        devices = [a for a in named.values() if isinstance(a, jax.Array)]
        if not self._pools(devices):
            fetched = iter(jax.device_get(devices))  # one batched transfer; on CPU views of the device buffers
            return {n: np.asarray(next(fetched) if isinstance(a, jax.Array) else a) for n, a in named.items()}
        # every transfer is in flight before the first is waited on
        staged = {n: self._start(a) for n, a in named.items() if isinstance(a, jax.Array)}
        out = {}
        for name, arr in named.items():
            if name not in staged:
                out[name] = np.asarray(arr)
                continue
            buf = self.buffers.take(name, tuple(arr.shape), arr.dtype)
            for index, data in staged.pop(name):  # drops each staged copy once gathered (pinned memory is scarce)
                buf[index] = np.asarray(data)  # waits for this shard's copy only
            out[name] = buf
        return out

    def _pools(self, arrays: list[jax.Array]) -> bool:
        if self.pooled is not None:
            return self.pooled and bool(arrays)
        return any(_platform(a) != "cpu" for a in arrays)

    def _start(self, arr: jax.Array) -> Shards:
        """Start copying `arr` to the host, each distinct box once (a replicated parameter is not copied from every
        device); the shards to gather once they are there."""
        shards = distinct_shards(arr)
        pinned = self.pinned if self.pinned is not None else _platform(arr) != "cpu" and offers_pinned(arr)
        if pinned:
            try:
                moved = jax.device_put([data for _, data in shards],
                                       [data.sharding.with_memory_kind(PINNED) for _, data in shards])
                shards = [(index, data) for (index, _), data in zip(shards, moved)]
            except (ValueError, NotImplementedError, jax.errors.JaxRuntimeError) as exc:
                # a backend that lists the memory but cannot place this array there: pageable copies from now on
                log.warning("weights: no copy to pinned host memory on %s (%s: %s); copying to pageable memory",
                            _platform(arr), type(exc).__name__, str(exc)[:200])
                self.pinned = False
        for _, data in shards:
            data.copy_to_host_async()
        return shards
