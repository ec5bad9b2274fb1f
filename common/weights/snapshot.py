"""Weight versions on the wire: a manifest (names, shapes, dtypes) plus slices streamed in checked chunks.

A published version is an immutable host snapshot on the trainer. A sampler
asks for the boxes (slices) of each tensor that its own devices hold under
its sharding; each box travels as contiguous C-order bytes in chunks whose
last one carries the box's CRC-32. `SliceAssembler` rebuilds the boxes and
checks sizes and CRCs before anything is installed, so a version is
installed whole or not at all.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
import zlib
from typing import Callable, Iterator, Sequence

import ml_dtypes  # noqa: F401 - registers numpy dtype names such as "bfloat16"
import numpy as np

from grpo_stream.protos import weights_pb2

DEFAULT_CHUNK_BYTES = 4 << 20
BASE_VERSION = -1  # LoRA: the frozen base weights of a trainer epoch, beside its adapters-only versions
Box = tuple[slice, ...]


def new_epoch() -> str:
    """A fresh trainer epoch id (one per trainer process)."""
    return uuid.uuid4().hex[:16]


@dataclasses.dataclass(frozen=True)
class WeightSnapshot:
    """One published version: host arrays by name, immutable once published."""

    version: int
    arrays: dict[str, np.ndarray]
    final: bool = False
    epoch: str = ""
    published_unix: float = dataclasses.field(default_factory=time.time)

    def manifest(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, transport: str = "grpc",
                 location: str = "") -> weights_pb2.WeightManifest:
        return manifest_of(self.version, {n: (a.shape, a.dtype) for n, a in self.arrays.items()}, self.final,
                           self.epoch, self.published_unix, chunk_bytes, transport, location)


def manifest_of(version: int, specs: dict[str, tuple[Sequence[int], np.dtype]], final: bool, epoch: str,
                published_unix: float, chunk_bytes: int, transport: str, location: str = "") -> weights_pb2.WeightManifest:
    tensors = [weights_pb2.TensorSpec(name=name, shape=list(shape), dtype=np.dtype(dtype).name,
                                      nbytes=int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
               for name, (shape, dtype) in specs.items()]
    return weights_pb2.WeightManifest(version=version, tensors=tensors, final=final,
                                      total_bytes=sum(t.nbytes for t in tensors), published_unix=published_unix,
                                      chunk_bytes=chunk_bytes, trainer_epoch=epoch, transport=transport,
                                      location=location)


def raw_bytes(arr: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes as a flat view (also for dtypes the buffer protocol lacks, e.g. bfloat16)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def box_to_proto(box: Box) -> weights_pb2.SliceRange:
    return weights_pb2.SliceRange(start=[s.start for s in box], stop=[s.stop for s in box])


def box_from_proto(rng: weights_pb2.SliceRange, shape: Sequence[int], where: str) -> Box:
    """A validated box; raises WeightTransferError naming `where` when it does not fit `shape`."""
    if len(rng.start) != len(shape) or len(rng.stop) != len(shape):
        raise WeightTransferError(f"{where}: slice has {len(rng.start)}/{len(rng.stop)} bounds for a "
                                  f"{len(shape)}-d tensor")
    for a, b, n in zip(rng.start, rng.stop, shape):
        if not 0 <= a < b <= n and not (n == 0 and a == b == 0):
            raise WeightTransferError(f"{where}: slice [{a}, {b}) outside dimension of size {n}")
    return tuple(slice(a, b) for a, b in zip(rng.start, rng.stop))


def box_key(box: Box) -> tuple:
    """A box as a hashable ((start, stop), ...)."""
    return tuple((s.start, s.stop) for s in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


def stream_box(arr: np.ndarray, box: Box, tensor_index: int, slice_index: int,
               chunk_bytes: int) -> Iterator[weights_pb2.SliceChunk]:
    """The bytes of `arr[box]` as chunks; the last chunk carries the CRC-32 of the whole box."""
    view = raw_bytes(arr[box])
    crc, total = 0, len(view)
    for offset in range(0, max(total, 1), chunk_bytes):
        piece = bytes(view[offset:offset + chunk_bytes])
        crc = zlib.crc32(piece, crc)
        last = offset + chunk_bytes >= total
        yield weights_pb2.SliceChunk(tensor_index=tensor_index, slice_index=slice_index, offset=offset, data=piece,
                                     last=last, crc32=crc if last else 0)


class WeightTransferError(ValueError):
    """Chunks that do not rebuild the requested slices, or a request that does not fit the manifest."""


class SliceAssembler:
    """Receives the chunks of requested boxes into preallocated buffers and checks each box's size and CRC.
    `take(key, shape, dtype)`: where a box's buffer comes from (the fetcher's ReceiveBuffers, keyed by (tensor
    index, box key)); None = a fresh array per box."""

    def __init__(self, manifest: weights_pb2.WeightManifest, request: dict[int, list[Box]],
                 take: Callable[[tuple, tuple[int, ...], np.dtype], np.ndarray] | None = None):
        self.manifest = manifest
        self.boxes = request
        self.buffers: dict[tuple[int, int], np.ndarray] = {}  # each box's bytes (flat uint8 views)
        self.typed: dict[tuple[int, int], np.ndarray] = {}  # the same buffers in the box's shape and wire dtype
        self.filled: dict[tuple[int, int], int] = {}
        self.done: set[tuple[int, int]] = set()
        for t, boxes in request.items():
            dtype = np.dtype(manifest.tensors[t].dtype)
            for k, box in enumerate(boxes):
                typed = (take((t, box_key(box)), box_shape(box), dtype) if take is not None
                         else np.empty(box_shape(box), dtype))
                self.typed[(t, k)] = typed
                self.buffers[(t, k)] = typed.reshape(-1).view(np.uint8)
                self.filled[(t, k)] = 0

    def add(self, chunk: weights_pb2.SliceChunk) -> None:
        key = (chunk.tensor_index, chunk.slice_index)
        buf = self.buffers.get(key)
        if buf is None:
            raise WeightTransferError(f"chunk for tensor {key[0]} slice {key[1]}, which was not requested")
        if key in self.done:
            raise WeightTransferError(f"chunk for tensor {key[0]} slice {key[1]} after its last chunk")
        end = chunk.offset + len(chunk.data)
        if chunk.offset < 0 or end > len(buf):
            raise WeightTransferError(f"chunk of {self.manifest.tensors[key[0]].name} overflows its slice of "
                                      f"{len(buf)} bytes")
        buf[chunk.offset:end] = np.frombuffer(chunk.data, np.uint8)
        self.filled[key] += len(chunk.data)
        if chunk.last:
            name = self.manifest.tensors[key[0]].name
            if self.filled[key] != len(buf):
                raise WeightTransferError(f"{name}: received {self.filled[key]} of {len(buf)} bytes of a slice")
            if zlib.crc32(buf) != chunk.crc32:
                raise WeightTransferError(f"{name}: CRC mismatch in slice {key[1]}")
            self.done.add(key)

    def arrays(self) -> dict[int, list[np.ndarray]]:
        """tensor index -> the requested boxes as arrays (in wire dtype); raises if any box is incomplete."""
        missing = [self.manifest.tensors[t].name for (t, _k) in self.buffers if (t, _k) not in self.done]
        if missing:
            raise WeightTransferError(f"{len(missing)} slices never completed (e.g. {missing[0]})")
        return {t: [self.typed[(t, k)] for k in range(len(boxes))] for t, boxes in self.boxes.items()}


def digest(named: dict[str, np.ndarray]) -> str:
    """SHA-256 over names, shapes, dtypes and bytes: equal digests mean bit-identical parameters."""
    h = hashlib.sha256()
    for name in sorted(named):
        arr = np.ascontiguousarray(named[name])
        h.update(f"{name}:{arr.dtype.name}:{list(arr.shape)};".encode())
        h.update(raw_bytes(arr))
    return h.hexdigest()
