"""Host buffers that the weights data plane receives slices into, refilled only when nothing else uses them.

Both ends of the grpc transport use them: a sampler receives slices into them (over the data plane or FetchSlices),
and on an accelerator the trainer's sink gathers each published version into them (host_staging.py).

Buffers are 64-byte aligned, so XLA's CPU client places them without a copy: the received bytes become the
parameters, which saves a full copy of the model per version (BENCHMARKS.md, "weights"). On GPU/TPU placing
copies to the device, and JAX holds the host buffer only until that copy is done.

A buffer is refilled for a later version only when this pool holds the sole reference to it (CPython reference
count). Installed parameters, an engine's cache of them, or a host-to-device copy in flight all keep it busy,
so the bytes of a version still in use are never overwritten. Reuse also avoids faulting in fresh pages for
every version.
"""

from __future__ import annotations

import sys

import numpy as np

ALIGN = 64  # bytes; XLA:CPU aliases host arrays aligned to this instead of copying them


class ReceiveBuffers:
    """Per slice key, up to `keep` buffers. `take` hands out a free one (or a new one) as an array view."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.allocated = 0  # buffers created rather than reused
        self._arenas: dict[tuple, list[np.ndarray]] = {}
        # the count `take` sees for a buffer that only its list holds, measured with the same expression rather
        # than assumed (interpreters differ in the temporary references they take)
        probe = [np.empty(1, np.uint8)]
        self._free_refs = sys.getrefcount(probe[0])

    def take(self, key: tuple, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A C-contiguous, 64-byte aligned, uninitialised array of `shape` and `dtype` for slice `key`."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        arenas = self._arenas.setdefault((key, tuple(shape), dtype.str), [])
        for i in range(len(arenas)):
            # any view handed out (and so any array placed from it, or still being copied to a device) holds
            # one more reference than a free buffer has
            if sys.getrefcount(arenas[i]) <= self._free_refs:
                return _view(arenas[i], nbytes, shape, dtype)
        arena = np.empty(nbytes + ALIGN, np.uint8)
        self.allocated += 1
        arenas.append(arena)
        if len(arenas) > self.keep:  # all busy: forget the oldest (freed once its last user lets go)
            arenas.pop(0)
        return _view(arena, nbytes, shape, dtype)


def _view(arena: np.ndarray, nbytes: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    offset = (-arena.ctypes.data) % ALIGN
    return arena[offset:offset + nbytes].view(dtype).reshape(shape)
