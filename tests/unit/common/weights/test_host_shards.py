"""Which trainer process serves which box of a tensor (multi-host trainer), and how a sampler splits and
reassembles the boxes it needs. The shardings here are stand-ins that report devices of several processes (one
test process has devices of one process only); the real two-process job runs in tests/e2e/test_multihost_trainer.py."""

import dataclasses

import numpy as np
import pytest

from grpo_stream.common.weights.host_shards import HeldBoxes, add_sources, serving_boxes, split_box
from grpo_stream.common.weights.snapshot import WeightTransferError, box_key, manifest_of
from grpo_stream.protos import weights_pb2


@dataclasses.dataclass(frozen=True)
class Device:
    id: int
    process_index: int


class Sharding:
    """devices_indices_map of a (rows over `row_parts`) x (replicated) layout over 2 processes x 2 devices."""

    def __init__(self, row_parts: int):
        self.row_parts = row_parts

    def devices_indices_map(self, shape):
        step = shape[0] // self.row_parts
        return {Device(d, d // 2): (slice((d % self.row_parts) * step, (d % self.row_parts + 1) * step),
                                    slice(None)) for d in range(4)}


def covered(boxes, shape) -> np.ndarray:
    count = np.zeros(shape, int)
    for box, _ in boxes:
        count[box] += 1
    return count


def test_the_served_boxes_tile_each_tensor_once():
    for parts in (4, 2, 1):  # fsdp over all 4 devices; over 2 (each box held twice); replicated
        boxes = serving_boxes((8, 3), Sharding(parts), tensor_index=5)
        assert len(boxes) == parts and (covered(boxes, (8, 3)) == 1).all()
    # fsdp=4 over [p0d0, p0d1, p1d0, p1d1]: each process serves the rows its devices hold
    assert [p for _, p in serving_boxes((8, 3), Sharding(4), 0)] == [0, 0, 1, 1]


def test_replicated_boxes_spread_over_the_processes_that_hold_them():
    # replicated on every device: whole tensors alternate between the processes, by tensor index
    assert [serving_boxes((4, 2), Sharding(1), t)[0][1] for t in range(4)] == [0, 1, 0, 1]
    # rows in 2 parts, each held by a device of both processes: the two boxes go to different processes
    assert sorted(p for _, p in serving_boxes((4, 2), Sharding(2), 0)) == [0, 1]


def test_held_boxes_serve_sub_boxes_of_what_they_hold_only():
    full = np.arange(24.0).reshape(6, 4)
    held = HeldBoxes(full.shape, full.dtype, {((0, 3), (0, 4)): ((slice(0, 3), slice(0, 4)), full[:3].copy())})
    np.testing.assert_array_equal(held[(slice(1, 3), slice(2, 4))], full[1:3, 2:4])
    assert held.holds((slice(0, 3), slice(0, 4))) and not held.holds((slice(2, 4), slice(0, 4)))
    assert held.nbytes == full[:3].nbytes
    with pytest.raises(WeightTransferError, match="not served by this trainer process"):
        held[(slice(2, 4), slice(0, 4))]


def test_a_sampler_box_is_split_along_the_sources_and_reassembled():
    full = np.arange(48.0, dtype=np.float32).reshape(8, 6)
    manifest = manifest_of(1, {"w": ((8, 6), np.float32)}, False, "e", 0.0, 64, "grpc")
    add_sources(manifest, {"w": serving_boxes((8, 6), Sharding(4), 0)})
    box = (slice(1, 7), slice(3, 6))  # a tensor-parallel sampler's column half, rows across 3 hosts' boxes
    parts = split_box(box, manifest.tensors[0], hosts=2)
    assert [(h, (p[0].start, p[0].stop)) for h, p in parts] == [(0, (1, 2)), (0, (2, 4)), (1, (4, 6)), (1, (6, 7))]
    rebuilt = np.full((6, 3), np.nan, np.float32)
    for _, p in parts:
        rebuilt[p[0].start - 1:p[0].stop - 1] = full[p]
    np.testing.assert_array_equal(rebuilt, full[box])
    with pytest.raises(WeightTransferError, match="names host 1, the manifest lists 1"):
        split_box(box, manifest.tensors[0], hosts=1)


def _spec(shape, sources):
    manifest = manifest_of(1, {"w": (shape, np.float32)}, False, "e", 0.0, 64, "grpc")
    for host, start, stop in sources:
        manifest.tensors[0].sources.add(host=host).box.MergeFrom(weights_pb2.SliceRange(start=start, stop=stop))
    return manifest.tensors[0]


@pytest.mark.parametrize("sources, named", [
    # rows 3-5 twice and 3-4 once more add up to the 48 elements while rows 5-7 come from nobody
    ([(0, [0, 0], [3, 6]), (1, [3, 0], [5, 6]), (1, [3, 0], [5, 6]), (1, [3, 0], [4, 6])],
     r"do not tile slice \(\(0, 8\), \(0, 6\)\) once: sources\[1\] overlaps"),
    # two column blocks overlapping in column 2 add up to the 48 elements while column 5 comes from nobody
    ([(0, [0, 0], [8, 3]), (1, [0, 2], [8, 5])], r"sources\[0\] overlaps another or ends mid-cell"),
    ([(0, [0, 0], [8, 3]), (1, [0, 3], [8, 5])], r"cover 40 of the 48"),
    ([(0, [0, 0], [3, 6]), (1, [3], [8])], r"sources\[1\] has 1/1 bounds for a 2-d tensor"),
], ids=["rows-listed-twice", "columns-overlap-hiding-a-gap", "columns-gap", "fewer-bounds"])
def test_sources_must_tile_a_box_each_element_once(sources, named):
    with pytest.raises(WeightTransferError, match=named):
        split_box((slice(0, 8), slice(0, 6)), _spec((8, 6), sources), hosts=2)


def test_sources_that_tile_a_box_as_a_grid_are_split_whatever_their_order():
    sources = [(1, [4, 3], [8, 6]), (0, [0, 0], [4, 3]), (1, [4, 0], [8, 3]), (0, [0, 3], [4, 6])]
    parts = split_box((slice(2, 7), slice(1, 6)), _spec((8, 6), sources), hosts=2)
    assert sorted((h, box_key(p)) for h, p in parts) == [(0, ((2, 4), (1, 3))), (0, ((2, 4), (3, 6))),
                                                         (1, ((4, 7), (1, 3))), (1, ((4, 7), (3, 6)))]
    scalar = _spec((), [(1, [], [])])
    assert split_box((), scalar, hosts=2) == [(1, ())]
