"""The WeightService over a publisher: manifests, the samplers' reports into the publisher's registry (a report of
another trainer epoch counts nowhere), and a fetch refused with the status the request earns."""

import threading
import weakref
from concurrent import futures

import grpc
import numpy as np
import pytest

from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS, SERVER_OPTIONS
from grpo_stream.common.weights.snapshot import WeightSnapshot
from grpo_stream.protos import weights_pb2, weights_pb2_grpc
from grpo_stream.trainer_service.publication.grpc_transport_server.slices import MAX_SLICES_PER_FETCH
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.publication.weight_service import WeightService
from tests.support import Aborted, AbortingContext


def test_manifests_and_reports_reach_the_publishers_registry():
    publisher = WeightPublisher(chunk_bytes=64, epoch="e1")
    service = WeightService(publisher)
    context = AbortingContext()
    with pytest.raises(Aborted):
        service.GetManifest(weights_pb2.GetManifestRequest(sampler_id="sampler-0", installed_version=-1), context)
    assert context.code == grpc.StatusCode.NOT_FOUND and not publisher.samplers.installed
    publisher.publish(WeightSnapshot(2, {"w": np.arange(8, dtype=np.float32)}))
    manifest = service.GetManifest(weights_pb2.GetManifestRequest(sampler_id="sampler-0", installed_version=1), None)
    # seen, no version recorded: the version a manifest request names is the newest the sampler fetched, which may
    # still wait for its engine (`drain`), and it carries no epoch; ReportVersion says what runs there
    assert manifest.version == 2 and publisher.samplers.installed == {"sampler-0": []}
    assert not publisher.samplers.samplers_at(1)["sampler-0"]
    reply = service.ReportVersion(weights_pb2.VersionReport(sampler_id="sampler-0", installed_version=1,
                                                            trainer_epoch="e1", fetch_failures=5,
                                                            groups_generated=4), None)
    assert reply.latest_version == 2 and publisher.samplers.installed["sampler-0"] == [1]
    # its next try starts with a manifest request that succeeds: the failures it reported stand until it reports
    service.GetManifest(weights_pb2.GetManifestRequest(sampler_id="sampler-0", installed_version=2), None)
    assert publisher.samplers.status(2)[0]["fetch_failures"] == 5
    assert publisher.samplers.installed["sampler-0"] == [1]
    service.ReportVersion(weights_pb2.VersionReport(sampler_id="sampler-1", installed_version=9,
                                                    trainer_epoch="another", groups_generated=5), None)
    assert "sampler-1" not in publisher.samplers.installed and publisher.samplers.groups_generated() == 4


def test_a_fetch_of_a_version_not_held_is_not_found_and_a_held_one_streams_whole():
    publisher = WeightPublisher(chunk_bytes=16, epoch="e1")
    service = WeightService(publisher)
    publisher.publish(WeightSnapshot(1, {"w": np.arange(8, dtype=np.float32)}))
    context = AbortingContext()
    with pytest.raises(Aborted):
        list(service.FetchSlices(weights_pb2.FetchSlicesRequest(version=7), context))
    assert context.code == grpc.StatusCode.NOT_FOUND
    whole = weights_pb2.TensorSlices(tensor_index=0, slices=[weights_pb2.SliceRange(start=[0], stop=[8])])
    chunks = list(service.FetchSlices(weights_pb2.FetchSlicesRequest(version=1, tensors=[whole]), None))
    assert len(chunks) == 2 and b"".join(c.data for c in chunks) == np.arange(8, dtype=np.float32).tobytes()


def test_a_trainer_process_serves_a_version_from_the_moment_it_announces_it():
    """A multi-host trainer's process announces each version (gather_hosts) before its publisher switches; process 0
    may list it in a manifest at once, and a sampler sent there must find the version, not NOT_FOUND and a back-off,
    while fetches of the version before it still stream."""
    publisher = WeightPublisher(chunk_bytes=64, epoch="e1")
    service = WeightService(publisher)
    whole = weights_pb2.TensorSlices(tensor_index=0, slices=[weights_pb2.SliceRange(start=[0], stop=[8])])
    fetched = {}

    def announce(manifest):  # a sampler's fetches arrive between the announcement and the switch
        for version in (manifest.version - 1, manifest.version):
            chunks = service.FetchSlices(weights_pb2.FetchSlicesRequest(version=version, trainer_epoch="e1",
                                                                        tensors=[whole]), AbortingContext())
            fetched[version] = np.frombuffer(b"".join(c.data for c in chunks), np.float32)

    publisher.publish(WeightSnapshot(1, {"w": np.full(8, 1, np.float32)}))
    publisher.gather_hosts = announce
    publisher.publish(WeightSnapshot(2, {"w": np.full(8, 2, np.float32)}))
    assert fetched[1].tolist() == [1.0] * 8 and fetched[2].tolist() == [2.0] * 8
    assert publisher.held(2).version == 2 and publisher.held(1).version == 2  # switched: the old one is gone


def test_a_fetch_that_stops_reading_is_cancelled_and_lets_its_version_go():
    """Over real gRPC: a client without a deadline that takes one chunk of a version and reads no more held that
    version's host snapshot (a copy of the model) and a server thread for ever, one more copy per version it did
    this to. A chunk not taken within the stall timeout now cancels the call and frees the snapshot; a fetch that
    reads streams whole under the same timeout."""
    publisher = WeightPublisher(chunk_bytes=1 << 20, epoch="e1")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=SERVER_OPTIONS)
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightService(publisher, stall_timeout_s=0.5), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    try:
        stub = weights_pb2_grpc.WeightServiceStub(channel)
        n = (32 << 20) // 4  # more than the transport's windows and socket buffers take without the reader
        arr = np.ones(n, np.float32)
        released = threading.Event()
        weakref.finalize(arr, released.set)
        publisher.publish(WeightSnapshot(0, {"w": arr}, epoch="e1"))
        del arr
        whole = weights_pb2.TensorSlices(tensor_index=0, slices=[weights_pb2.SliceRange(start=[0], stop=[n])])
        stalled = stub.FetchSlices(weights_pb2.FetchSlicesRequest(version=0, trainer_epoch="e1", tensors=[whole]))
        next(stalled)  # then reads nothing more
        publisher.publish(WeightSnapshot(1, {"w": np.full(8, 1, np.float32)}, epoch="e1"))
        assert released.wait(timeout=30), "the stalled fetch still holds version 0's snapshot"
        with pytest.raises(grpc.RpcError) as err:
            list(stalled)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        small = weights_pb2.TensorSlices(tensor_index=0, slices=[weights_pb2.SliceRange(start=[0], stop=[8])])
        chunks = list(stub.FetchSlices(weights_pb2.FetchSlicesRequest(version=1, trainer_epoch="e1", tensors=[small]),
                                       timeout=30))
        assert np.frombuffer(b"".join(c.data for c in chunks), np.float32).tolist() == [1.0] * 8
    finally:
        channel.close()
        server.stop(0)


def test_an_overlong_sampler_id_is_refused_naming_the_field_and_never_held():
    """Without auth any id was recorded whole: 1024 ids of a message's size (64 MiB) made gigabytes of registry."""
    publisher = WeightPublisher(chunk_bytes=64, epoch="e1")
    service = WeightService(publisher)
    publisher.publish(WeightSnapshot(1, {"w": np.arange(8, dtype=np.float32)}))
    long_id = "x" * (1 << 20)
    for call, request in ((service.GetManifest, weights_pb2.GetManifestRequest(sampler_id=long_id)),
                          (service.ReportVersion, weights_pb2.VersionReport(sampler_id=long_id, installed_version=1,
                                                                            trainer_epoch="e1"))):
        context = AbortingContext()
        with pytest.raises(Aborted):
            call(request, context)
        assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "sampler_id" in context.details
    assert not publisher.samplers.installed
    service.ReportVersion(weights_pb2.VersionReport(sampler_id="sampler-0", installed_version=1, trainer_epoch="e1"),
                          None)
    assert publisher.samplers.installed == {"sampler-0": [1]}


def test_a_fetch_of_too_many_slices_is_refused_naming_the_field_before_any_is_planned():
    """Slices of one element each stay within the version's bytes, yet each costs the trainer a plan entry and a
    chunk: a request of millions (a 64 MiB message holds that many) held a server thread on them."""
    publisher = WeightPublisher(chunk_bytes=1 << 20, epoch="e1")
    service = WeightService(publisher)
    count = MAX_SLICES_PER_FETCH + 1
    publisher.publish(WeightSnapshot(1, {"w": np.zeros(count, dtype=np.int8)}))
    ones = weights_pb2.TensorSlices(tensor_index=0, slices=[weights_pb2.SliceRange(start=[i], stop=[i + 1])
                                                            for i in range(count)])
    context = AbortingContext()
    with pytest.raises(Aborted):
        next(service.FetchSlices(weights_pb2.FetchSlicesRequest(version=1, tensors=[ones]), context))
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert context.details.startswith(f"tensors.slices: {count} slices in one fetch, more than {MAX_SLICES_PER_FETCH}")
    del ones.slices[1:]
    chunks = list(service.FetchSlices(weights_pb2.FetchSlicesRequest(version=1, tensors=[ones]), None))
    assert [c.data for c in chunks] == [b"\0"]
