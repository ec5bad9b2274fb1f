"""The grpc sink's host copies: gathered into host buffers reused across versions, equal to the published
parameters every time (wire dtype included), and never overwritten while a version is served or still streamed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.weights.grpc_transport import GrpcSink
from grpo_stream.common.weights.host_staging import HostStaging
from grpo_stream.common.weights.snapshot import SliceAssembler, box_from_proto
from grpo_stream.protos import weights_pb2
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.publication.weight_service import WeightService

CHUNK = 1 << 16


def params(version: int) -> dict[str, jax.Array]:
    base = {"embed": jnp.arange(96 * 40, dtype=jnp.float32).reshape(96, 40) / 7, "bias": jnp.linspace(-1, 1, 33),
            "scale": jnp.asarray(0.5, jnp.float32)}
    return {name: a * (version + 1) + version for name, a in base.items()}


def publisher(staging: HostStaging, wire_dtype: str = "model") -> WeightPublisher:
    return WeightPublisher(GrpcSink(CHUNK, staging), "grpc", chunk_bytes=CHUNK, wire_dtype=wire_dtype)


def pointers(snapshot) -> dict[str, int]:
    return {name: arr.__array_interface__["data"][0] for name, arr in snapshot.arrays.items()}


def assert_holds(snapshot, version: int, dtype=None) -> None:
    for name, arr in params(version).items():
        expected = np.asarray(arr.astype(dtype) if dtype is not None else arr)
        assert snapshot.arrays[name].dtype == expected.dtype
        np.testing.assert_array_equal(snapshot.arrays[name], expected)


@pytest.mark.parametrize("pinned", [False, True])
def test_versions_take_turns_in_two_sets_of_host_buffers(pinned):
    staging = HostStaging(pooled=True, pinned=pinned)  # pinned: the accelerators' path, run on CPU's pinned memory
    pub = publisher(staging)
    seen = []
    for version in range(6):
        pub.publish_arrays(version, params(version))
        assert_holds(pub._snapshot, version)
        seen.append(pointers(pub._snapshot))
    assert staging.buffers.allocated == 2 * len(seen[0])  # two sets made, then only reused
    assert all(seen[v] == seen[v % 2] for v in range(6)) and seen[0] != seen[1]
    assert staging.pinned is pinned  # the pinned path ran without falling back


def test_the_wire_dtype_is_gathered_into_buffers_of_that_dtype():
    staging = HostStaging(pooled=True)
    pub = publisher(staging, wire_dtype="bfloat16")
    for version in range(4):
        stats = pub.publish_arrays(version, params(version))
        assert_holds(pub._snapshot, version, jnp.bfloat16)
        assert stats.nbytes == sum(a.size * 2 for a in params(0).values())
    assert staging.buffers.allocated == 2 * 3


def whole_request(pub: WeightPublisher, version: int) -> weights_pb2.FetchSlicesRequest:
    return weights_pb2.FetchSlicesRequest(version=version, tensors=[
        weights_pb2.TensorSlices(tensor_index=t, slices=[weights_pb2.SliceRange(start=[0] * len(a.shape),
                                                                                 stop=list(a.shape))])
        for t, a in enumerate(pub._snapshot.arrays.values())])


def test_a_version_a_fetch_still_streams_is_not_overwritten_by_later_ones():
    staging = HostStaging(pooled=True)
    pub = publisher(staging)
    pub.publish_arrays(0, params(0))
    pub.publish_arrays(1, params(1))
    manifest, request = pub._manifest, whole_request(pub, 1)
    # a sampler's fetch of version 1, slowed down to one chunk so far
    stream = WeightService(pub).FetchSlices(request, None)
    chunks = [next(stream)]
    for version in range(2, 6):  # the trainer publishes on; version 1 stays held by the fetch
        pub.publish_arrays(version, params(version))
        assert_holds(pub._snapshot, version)
    chunks.extend(stream)
    boxes = {t: [box_from_proto(s.slices[0], manifest.tensors[t].shape, "test")] for t, s in enumerate(request.tensors)}
    assembler = SliceAssembler(manifest, boxes)
    for chunk in chunks:
        assembler.add(chunk)
    got = assembler.arrays()
    for t, (name, arr) in enumerate(params(1).items()):
        np.testing.assert_array_equal(got[t][0], np.asarray(arr))
    # version 1's buffers were left alone while streamed; released, they are taken again
    del stream, chunks
    made = staging.buffers.allocated
    for version in range(6, 9):
        pub.publish_arrays(version, params(version))
        assert_holds(pub._snapshot, version)
    assert staging.buffers.allocated == made


def test_on_cpu_the_plain_path_views_the_device_buffers():
    staging = HostStaging()
    arrays = params(0)
    host = staging.to_host({**arrays, "given": np.ones(3, np.float32)})
    assert staging.buffers.allocated == 0
    np.testing.assert_array_equal(host["given"], 1.0)
    for name, arr in arrays.items():
        np.testing.assert_array_equal(host[name], np.asarray(arr))
