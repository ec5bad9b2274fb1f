import numpy as np
import pytest

from common.weights import WeightSnapshot, WeightTransferError, assemble


def snapshot():
    rng = np.random.default_rng(0)
    return WeightSnapshot(version=5, arrays={"a.w": rng.standard_normal((7, 3)).astype(np.float32),
                                             "b": rng.standard_normal(1000).astype(np.float32),
                                             "scalar": np.float32(2.0).reshape(())})


def test_roundtrip_through_small_chunks():
    snap = snapshot()
    manifest = snap.manifest(chunk_bytes=64)
    out = assemble(manifest, snap.chunks(64))
    assert list(out) == list(snap.arrays)
    for name in out:
        np.testing.assert_array_equal(out[name], snap.arrays[name])
    assert manifest.version == 5 and manifest.total_bytes == sum(a.nbytes for a in snap.arrays.values())


def test_missing_chunk_is_detected():
    snap = snapshot()
    chunks = list(snap.chunks(64))
    with pytest.raises(WeightTransferError, match="received"):
        assemble(snap.manifest(64), chunks[:-1])


def test_corrupt_chunk_is_detected():
    snap = snapshot()
    chunks = list(snap.chunks(64))
    chunks[2].data = bytes(len(chunks[2].data))
    with pytest.raises(WeightTransferError, match="CRC mismatch"):
        assemble(snap.manifest(64), chunks)


def test_out_of_range_chunk_is_refused():
    snap = snapshot()
    chunks = list(snap.chunks(64))
    chunks[0].tensor_index = 9
    with pytest.raises(WeightTransferError, match="outside"):
        assemble(snap.manifest(64), chunks)


def test_bfloat16_weights_round_trip():
    import ml_dtypes

    from common.weights import WeightSnapshot, assemble

    arrays = {"a": np.random.default_rng().standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
              "b": np.arange(3, dtype=np.float32)}
    snap = WeightSnapshot(version=3, arrays=arrays)
    back = assemble(snap.manifest(64), snap.chunks(64))
    assert back["a"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back["a"], arrays["a"])
    np.testing.assert_array_equal(back["b"], arrays["b"])
