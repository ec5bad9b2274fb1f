import ml_dtypes
import numpy as np
import pytest

from grpo_stream.common.weights.snapshot import (SliceAssembler, WeightSnapshot, WeightTransferError, box_from_proto, box_to_proto,
                            digest, stream_box)
from grpo_stream.protos import weights_pb2


def snapshot():
    rng = np.random.default_rng(0)
    return WeightSnapshot(version=5, arrays={"a.w": rng.standard_normal((7, 6)).astype(np.float32),
                                             "b": rng.standard_normal(1000).astype(np.float32),
                                             "scalar": np.float32(2.0).reshape(())})


def boxes_of(shape, parts):
    """Split dimension 0 of `shape` into `parts` boxes (a sampler's per-device slices)."""
    edges = np.linspace(0, shape[0], parts + 1).astype(int)
    return [tuple([slice(a, b)] + [slice(0, n) for n in shape[1:]]) for a, b in zip(edges[:-1], edges[1:])]


def stream(snap, request, chunk):
    arrays = list(snap.arrays.values())
    for t, boxes in request.items():
        for k, box in enumerate(boxes):
            yield from stream_box(arrays[t], box, t, k, chunk)


def test_slices_round_trip_through_small_chunks():
    snap = snapshot()
    manifest = snap.manifest(chunk_bytes=64)
    request = {0: boxes_of((7, 6), 3), 1: boxes_of((1000,), 2), 2: [()]}
    assembler = SliceAssembler(manifest, request)
    for chunk in stream(snap, request, 64):
        assembler.add(chunk)
    out = assembler.arrays()
    np.testing.assert_array_equal(np.concatenate(out[0]), snap.arrays["a.w"])
    np.testing.assert_array_equal(np.concatenate(out[1]), snap.arrays["b"])
    assert out[2][0] == 2.0
    assert manifest.version == 5 and manifest.total_bytes == sum(a.nbytes for a in snap.arrays.values())


def test_column_slices_are_contiguous_copies():
    snap = snapshot()
    box = (slice(0, 7), slice(2, 5))  # a tp shard along the second dimension: not contiguous in the source
    assembler = SliceAssembler(snap.manifest(), {0: [box]})
    for chunk in stream_box(snap.arrays["a.w"], box, 0, 0, 16):
        assembler.add(chunk)
    np.testing.assert_array_equal(assembler.arrays()[0][0], snap.arrays["a.w"][:, 2:5])


def test_missing_chunk_is_detected():
    snap = snapshot()
    request = {1: boxes_of((1000,), 1)}
    chunks = list(stream(snap, request, 64))
    assembler = SliceAssembler(snap.manifest(), request)
    for chunk in chunks[:-2]:  # one chunk lost before the last
        assembler.add(chunk)
    with pytest.raises(WeightTransferError, match="received 3936 of 4000 bytes"):
        assembler.add(chunks[-1])
    with pytest.raises(WeightTransferError, match="never completed"):
        SliceAssembler(snap.manifest(), request).arrays()


def test_corrupt_chunk_is_detected():
    snap = snapshot()
    request = {1: boxes_of((1000,), 1)}
    chunks = list(stream(snap, request, 64))
    chunks[2].data = bytes(len(chunks[2].data))
    assembler = SliceAssembler(snap.manifest(), request)
    with pytest.raises(WeightTransferError, match="CRC mismatch"):
        for chunk in chunks:
            assembler.add(chunk)


def test_unrequested_or_overflowing_chunks_are_refused():
    snap = snapshot()
    request = {0: boxes_of((7, 6), 1)}
    chunk = next(stream(snap, request, 64))
    assembler = SliceAssembler(snap.manifest(), request)
    chunk.tensor_index = 9
    with pytest.raises(WeightTransferError, match="not requested"):
        assembler.add(chunk)
    chunk.tensor_index, chunk.offset = 0, 10_000
    with pytest.raises(WeightTransferError, match="overflows"):
        assembler.add(chunk)


def test_a_chunk_after_a_checked_slice_cannot_overwrite_it():
    snap = snapshot()
    request = {0: boxes_of((7, 6), 1)}
    chunks = list(stream(snap, request, 1 << 20))
    assembler = SliceAssembler(snap.manifest(), request)
    for chunk in chunks:
        assembler.add(chunk)
    stray = chunks[0]
    stray.data = bytes(len(stray.data))
    with pytest.raises(WeightTransferError, match="after its last chunk"):
        assembler.add(stray)


def test_bad_boxes_name_the_problem():
    with pytest.raises(WeightTransferError, match="outside dimension of size 6"):
        box_from_proto(weights_pb2.SliceRange(start=[0, 4], stop=[7, 9]), (7, 6), "tensor 0")
    with pytest.raises(WeightTransferError, match="1/1 bounds for a 2-d"):
        box_from_proto(weights_pb2.SliceRange(start=[0], stop=[7]), (7, 6), "tensor 0")
    box = (slice(1, 3), slice(0, 6))
    assert box_from_proto(box_to_proto(box), (7, 6), "t") == box


def test_bfloat16_slices_round_trip():
    arrays = {"a": np.random.default_rng().standard_normal((6, 8)).astype(ml_dtypes.bfloat16)}
    snap = WeightSnapshot(version=3, arrays=arrays)
    request = {0: boxes_of((6, 8), 2)}
    assembler = SliceAssembler(snap.manifest(), request)
    for chunk in stream(snap, request, 16):
        assembler.add(chunk)
    back = np.concatenate(assembler.arrays()[0])
    assert back.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back, arrays["a"])


def test_digest_changes_with_any_bit_and_ignores_order():
    snap = snapshot()
    base = digest(snap.arrays)
    assert digest(dict(reversed(list(snap.arrays.items())))) == base
    flipped = dict(snap.arrays)
    flipped["b"] = flipped["b"].copy()
    flipped["b"].view(np.uint32)[17] ^= 1
    assert digest(flipped) != base
