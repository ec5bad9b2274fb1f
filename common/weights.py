"""Weight versions on the wire: a manifest (names, shapes, dtypes, CRCs) plus byte chunks.

The trainer turns a host snapshot of its parameters into a manifest and a
sequence of chunks; a sampler reassembles them and checks every tensor's
size and CRC before it installs anything, so a version is installed whole
or not at all.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from typing import Iterable, Iterator

import ml_dtypes  # noqa: F401 - registers numpy dtype names such as "bfloat16" for assemble()
import numpy as np

from protos import weights_pb2

DEFAULT_CHUNK_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class WeightSnapshot:
    """One published version: host arrays by name, immutable once published."""

    version: int
    arrays: dict[str, np.ndarray]
    final: bool = False
    published_unix: float = dataclasses.field(default_factory=time.time)

    def manifest(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> weights_pb2.WeightManifest:
        specs = []
        for name, arr in self.arrays.items():
            buf = np.ascontiguousarray(arr)
            specs.append(weights_pb2.TensorSpec(name=name, shape=list(buf.shape), dtype=buf.dtype.name,
                                                nbytes=buf.nbytes, crc32=zlib.crc32(_raw_bytes(buf))))
        return weights_pb2.WeightManifest(version=self.version, tensors=specs, final=self.final,
                                          total_bytes=sum(s.nbytes for s in specs),
                                          published_unix=self.published_unix, chunk_bytes=chunk_bytes)

    def chunks(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[weights_pb2.WeightChunk]:
        for index, arr in enumerate(self.arrays.values()):
            view = _raw_bytes(np.ascontiguousarray(arr))
            for offset in range(0, max(len(view), 1), chunk_bytes):
                yield weights_pb2.WeightChunk(tensor_index=index, offset=offset,
                                              data=bytes(view[offset:offset + chunk_bytes]))


def _raw_bytes(arr: np.ndarray) -> memoryview:
    """The array's bytes as a flat byte view (also for dtypes the buffer protocol lacks, e.g. bfloat16)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


class WeightTransferError(ValueError):
    """Chunks that do not rebuild the manifest's tensors."""


def assemble(manifest: weights_pb2.WeightManifest, chunks: Iterable[weights_pb2.WeightChunk]) -> dict[str, np.ndarray]:
    """Rebuild name -> array from chunks; raises WeightTransferError on any gap, overflow or CRC mismatch."""
    buffers = [bytearray(spec.nbytes) for spec in manifest.tensors]
    filled = [0] * len(buffers)
    for chunk in chunks:
        i = chunk.tensor_index
        if not 0 <= i < len(buffers):
            raise WeightTransferError(f"chunk tensor_index {i} outside the manifest's {len(buffers)} tensors")
        end = chunk.offset + len(chunk.data)
        if chunk.offset < 0 or end > len(buffers[i]):
            raise WeightTransferError(f"chunk of {manifest.tensors[i].name} overflows its {len(buffers[i])} bytes")
        buffers[i][chunk.offset:end] = chunk.data
        filled[i] += len(chunk.data)
    out = {}
    for spec, buf, n in zip(manifest.tensors, buffers, filled):
        if n != spec.nbytes:
            raise WeightTransferError(f"{spec.name}: received {n} of {spec.nbytes} bytes")
        if zlib.crc32(buf) != spec.crc32:
            raise WeightTransferError(f"{spec.name}: CRC mismatch")
        out[spec.name] = np.frombuffer(bytes(buf), dtype=np.dtype(spec.dtype)).reshape(tuple(spec.shape))
    return out
