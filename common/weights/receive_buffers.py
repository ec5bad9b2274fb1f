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

JAX lets go of a host buffer it placed or copied from on one of its own threads, which may not take the GIL: it
queues the Python reference and drops it at the next garbage collection (a `gc` callback). Until then the buffer
of a version the sampler already replaced still counts as busy, and every fetch in a row made a new set (four model
copies alive instead of two in a fetch loop on CPU). So when every buffer of a slot is busy, the pool runs a
young-generation collection, once per version, and looks again before it makes a new one.

A buffer is let go once its slot (key, shape, dtype) was not asked for in ROUNDS_KEPT versions: after a change of
shapes or keys (a manifest with other tensors or another order, a trainer that became multi-host) the old slots'
buffers were kept for good, up to `keep` copies of the model per change. The pool tells versions apart by its
callers' pattern, each slot key taken once per version: a key taken again starts the next one.
"""

from __future__ import annotations

import gc
import sys
import threading

import numpy as np

ALIGN = 64  # bytes; XLA:CPU aliases host arrays aligned to this instead of copying them
ROUNDS_KEPT = 2  # versions a slot's buffers outlive its last use: one retried after a failed, partial one keeps them


class ReceiveBuffers:
    """Per slice key, up to `keep` buffers. `take` hands out a free one (or a new one) as an array view."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.allocated = 0  # buffers created rather than reused
        self._arenas: dict[tuple, list[np.ndarray]] = {}
        self._used: dict[tuple, int] = {}  # slot -> the round (version) that last took it
        self._round, self._keys_this_round = 0, set()
        self._collected = False  # this round ran the collection that drops JAX's queued references (above)
        self._lock = threading.Lock()  # the fetch lanes take from several threads, and a new round edits the dicts
        # the count `take` sees for a buffer that only its list holds, measured with the same expression rather
        # than assumed (interpreters differ in the temporary references they take)
        probe = [np.empty(1, np.uint8)]
        self._free_refs = sys.getrefcount(probe[0])

    def take(self, key: tuple, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A C-contiguous, 64-byte aligned, uninitialised array of `shape` and `dtype` for slice `key`."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        slot = (key, tuple(shape), dtype.str)
        with self._lock:
            if key in self._keys_this_round:
                self._next_round()
            self._keys_this_round.add(key)
            self._used[slot] = self._round
            return self._take(slot, nbytes, shape, dtype)

    def _next_round(self) -> None:
        """A new version: forget the slots not taken in the last ROUNDS_KEPT (their busy buffers live on with
        their users, as the ones `keep` drops)."""
        self._round += 1
        self._keys_this_round.clear()
        self._collected = False
        for slot in [s for s, used in self._used.items() if used < self._round - ROUNDS_KEPT]:
            del self._used[slot]
            self._arenas.pop(slot, None)

    def _take(self, slot: tuple, nbytes: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        arenas = self._arenas.setdefault(slot, [])
        free = self._free(arenas)
        if free is None and arenas and not self._collected:
            self._collected = True
            gc.collect(0)  # its callbacks drop the references JAX queued (see above); the young generation is cheap
            free = self._free(arenas)
        if free is not None:
            return _view(free, nbytes, shape, dtype)
        arena = np.empty(nbytes + ALIGN, np.uint8)
        self.allocated += 1
        arenas.append(arena)
        if len(arenas) > self.keep:  # all busy: forget the oldest (freed once its last user lets go)
            arenas.pop(0)
        return _view(arena, nbytes, shape, dtype)

    def _free(self, arenas: list[np.ndarray]) -> np.ndarray | None:
        for i in range(len(arenas)):
            # any view handed out (and so any array placed from it, or still being copied to a device) holds
            # one more reference than a free buffer has
            if sys.getrefcount(arenas[i]) <= self._free_refs:
                return arenas[i]
        return None


def _view(arena: np.ndarray, nbytes: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    offset = (-arena.ctypes.data) % ALIGN
    return arena[offset:offset + nbytes].view(dtype).reshape(shape)
