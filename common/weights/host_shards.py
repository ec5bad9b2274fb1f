"""Weights served from every host of a multi-host trainer (trainer.processes > 1).

A trainer process of a multi-controller JAX job holds only its own shards of each parameter; no process can (or
should) gather a 70B model. So each process serves the boxes it holds, and the manifest says, per tensor, which
host serves which box (`TensorSpec.sources`, `WeightManifest.hosts`). Every process computes the same map from the
arrays' shardings alone (`serving_boxes`), so no map travels between them. A sampler splits each box its own
devices need along the sources it overlaps (`split_box`), fetches the parts from their hosts in parallel and
assembles its boxes (common/weights/grpc_transport.py).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from grpo_stream.common.model.sharding import normalized
from grpo_stream.common.weights.snapshot import Box, WeightTransferError, box_key, box_shape
from grpo_stream.protos import weights_pb2


def relative(part: Box, box: Box) -> Box:
    """`part` (a box inside `box`) as an index into the array of `box`."""
    return tuple(slice(p.start - b.start, p.stop - b.start) for p, b in zip(part, box))


def serving_boxes(shape: Sequence[int], sharding: jax.sharding.Sharding, tensor_index: int) -> list[tuple[Box, int]]:
    """(box, process) for each distinct box of an array of `shape` under `sharding`: the boxes tile the array, and
    each is served by one process that holds it. A box held by several processes (replicated parameters, or a
    replicated axis) goes to one of them in turn, by tensor and box, so the serving load spreads over the hosts."""
    holders: dict[tuple, tuple[Box, set[int]]] = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        box = normalized(index, shape)
        holders.setdefault(box_key(box), (box, set()))[1].add(device.process_index)
    out = []
    for k, key in enumerate(sorted(holders)):
        box, processes = holders[key]
        choice = sorted(processes)
        out.append((box, choice[(tensor_index + k) % len(choice)]))
    return out


class HeldBoxes:
    """The boxes of one tensor that this process serves, as host arrays: what a WeightSnapshot holds per tensor on
    a multi-host trainer. Reads (`arr[box]`) must fall inside one held box."""

    def __init__(self, shape: Sequence[int], dtype: np.dtype, pieces: dict[tuple, tuple[Box, np.ndarray]]):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.pieces = pieces
        self.nbytes = sum(a.nbytes for _, a in pieces.values())  # what this process holds, not the whole tensor

    def _find(self, box: Box) -> tuple[Box, np.ndarray] | None:
        for held, arr in self.pieces.values():
            if all(h.start <= b.start and b.stop <= h.stop for h, b in zip(held, box)):
                return held, arr
        return None

    def holds(self, box: Box) -> bool:
        return self._find(box) is not None

    def __getitem__(self, box: Box) -> np.ndarray:
        found = self._find(box)
        if found is None:
            raise WeightTransferError(f"slice {[(s.start, s.stop) for s in box]} is not served by this trainer "
                                      "process; ask the host the manifest's sources name")
        held, arr = found
        return arr[relative(box, held)]


def host_shard_snapshot(named: dict[str, jax.Array]) -> tuple[dict[str, HeldBoxes], dict[str, list[tuple[Box, int]]]]:
    """(this process's served boxes per tensor, every tensor's sources) of global arrays `named`: each served box
    is copied to the host from the local device that holds it, every copy started before the first is waited on."""
    me = jax.process_index()
    copying, sources = {}, {}
    for t, (name, arr) in enumerate(named.items()):
        boxes = serving_boxes(arr.shape, arr.sharding, t)
        sources[name] = boxes
        mine = {box_key(box) for box, process in boxes if process == me}
        pieces: dict[tuple, tuple[Box, jax.Array]] = {}
        for shard in arr.addressable_shards:
            box = normalized(shard.index, arr.shape)
            if box_key(box) in mine and box_key(box) not in pieces:
                shard.data.copy_to_host_async()
                pieces[box_key(box)] = (box, shard.data)
        copying[name] = (arr, pieces)
    held = {name: HeldBoxes(arr.shape, arr.dtype, {k: (box, np.asarray(data)) for k, (box, data) in pieces.items()})
            for name, (arr, pieces) in copying.items()}
    return held, sources


def add_sources(manifest: weights_pb2.WeightManifest, sources: dict[str, list[tuple[Box, int]]]) -> None:
    """Write each tensor's (box, host) sources into `manifest` (in place)."""
    for spec in manifest.tensors:
        for box, host in sources[spec.name]:
            spec.sources.add(host=host, box=weights_pb2.SliceRange(start=[s.start for s in box],
                                                                   stop=[s.stop for s in box]))


def split_box(box: Box, spec: weights_pb2.TensorSpec, hosts: int) -> list[tuple[int, Box]]:
    """(host, part) covering `box` of a tensor from the manifest's sources; raises when they do not tile it."""
    parts, covered, where = [], 0, []
    for i, source in enumerate(spec.sources):
        if source.host < 0 or source.host >= hosts:
            raise WeightTransferError(f"{spec.name}: a source names host {source.host}, the manifest lists {hosts}")
        if len(source.box.start) != len(box) or len(source.box.stop) != len(box):
            raise WeightTransferError(f"{spec.name}: the manifest's sources[{i}] has {len(source.box.start)}/"
                                      f"{len(source.box.stop)} bounds for a {len(box)}-d tensor")
        part = tuple(slice(max(b.start, a), min(b.stop, z)) for b, a, z in zip(box, source.box.start, source.box.stop))
        if all(s.start < s.stop for s in part):
            parts.append((source.host, part))
            where.append(i)
            covered += int(np.prod(box_shape(part), dtype=np.int64))
    if covered != int(np.prod(box_shape(box), dtype=np.int64)):
        raise WeightTransferError(f"{spec.name}: the manifest's sources cover {covered} of the "
                                  f"{int(np.prod(box_shape(box)))} elements of slice {box_key(box)}")
    _check_cells(box, spec.name, [part for _, part in parts], where)
    return parts


def _check_cells(box: Box, name: str, parts: list[Box], where: list[int]) -> None:
    """Raise unless each of `parts` (from the sources numbered `where`) is its own cell of the grid their starts cut
    `box` into. With their sizes adding up to the box's (checked before) they then tile it, each element once:
    sizes alone let sources listed twice, or overlapping, hide a part of the box that no host sends, and the sampler
    installed those elements unreceived (whatever its receive buffer held). A trainer's sources are one sharding's
    boxes, a grid, as is their cut by a sampler's box; checked in O(parts), not pairwise."""
    next_cut = []  # per dimension: a part's start -> where the cell from there ends
    for d, b in enumerate(box):
        starts = sorted({p[d].start for p in parts})
        next_cut.append(dict(zip(starts, starts[1:] + [b.stop])))
    cells = set()
    for part, i in zip(parts, where):
        cell = tuple(s.start for s in part)
        if cell in cells or any(next_cut[d][s.start] != s.stop for d, s in enumerate(part)):
            raise WeightTransferError(f"{name}: the manifest's sources do not tile slice {box_key(box)} once: "
                                      f"sources[{i}] overlaps another or ends mid-cell; each element must come "
                                      "from one host")
        cells.add(cell)
