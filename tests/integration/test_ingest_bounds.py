"""The ingest's bounds on what a sampler sends, on a real gRPC ingest with a real Redis buffer: a weight version no
trainer published, free text past its limit, and a refused group sent again (its admission count stays exact)."""

import grpc
import numpy as np
import pytest

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.wire import CompletionData, GroupData, GroupLimits, to_proto
from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc
from grpo_stream.trainer_service.ingest.admission import VERSIONS_AHEAD, AdmissionControl, AdmissionLimits
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer

pytestmark = pytest.mark.redis
LIMITS = GroupLimits(num_generations=2, max_prompt_tokens=8, max_new_tokens=6, vocab_size=50)
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
MAX_TEXT = 100


def group(i: int, version: int = 0, versions=None, reference: str = "", sampler: str = "sampler-0"):
    comps = [CompletionData(np.array([3, 4], np.int32), np.array([-0.5, -1.0], np.float32), float(j), False,
                            versions=None if versions is None else np.asarray(versions, np.int64))
             for j in range(2)]
    return to_proto(GroupData(f"{sampler}/g{i}", f"p{i}", np.array([1, 2], np.int32), comps, version, sampler,
                              reference_answer=reference, data_position=i))


@pytest.fixture
def ingest(shared_redis, run_name):
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    control = AdmissionControl(AdmissionLimits(4, 1, steps=3))
    servicer = IngestServicer(buffer, LIMITS, 100, 20, admission=control, max_text_chars=MAX_TEXT)
    server = TrainerServer(servicer, WeightPublisher(), "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}", options=CHANNEL_OPTIONS)
    try:
        yield buffer, control, rollout_pb2_grpc.RolloutIngestStub(channel)
    finally:
        channel.close()
        server.stop(0)


def acks(stub, *groups):
    (reply,) = stub.StreamBatches(iter([rollout_pb2.RolloutBatch(groups=list(groups))]))
    return list(reply.acks)


def test_a_version_no_trainer_published_is_refused_naming_the_field(ingest):
    """A group (or a token's version run) of a version far past the trainer's was accepted: it filled the buffer and
    was dropped as stale at best; a token run from the future passed the collector and counted as fresh."""
    buffer, _, stub = ingest
    far = 10**12
    future, future_run, edge = group(1, far), group(2, 0, versions=[0, far]), group(3, VERSIONS_AHEAD)
    got = acks(stub, future, future_run, edge)
    assert [a.code for a in got] == [INVALID, INVALID, 0]
    assert got[0].message.startswith(f"policy_version: {far} is ahead of the newest weight version")
    assert "completions[0].version_runs" in got[1].message and str(far) in got[1].message
    assert buffer.depth() == 1
    # a trainer resumed from the checkpoint of step 500 publishes version 500 before it logs a step
    buffer.log_trainer("epoch-b", 500, "epoch-a")
    assert [a.code for a in acks(stub, group(4, 500 + VERSIONS_AHEAD), group(5, 501 + VERSIONS_AHEAD))] == [0, INVALID]


def test_oversized_free_text_is_refused_and_never_stored(ingest):
    buffer, _, stub = ingest
    got = acks(stub, group(1, reference="x" * (MAX_TEXT + 1)), group(2, reference="é" * MAX_TEXT))
    assert [a.code for a in got] == [INVALID, 0]
    assert got[0].message.startswith(f"reference_answer: {MAX_TEXT + 1} characters, limit {MAX_TEXT}")
    assert "prompts.max_text_chars" in got[0].message
    assert buffer.depth() == 1


def test_a_refused_group_sent_again_is_counted_answered_once(ingest):
    """A sampler that lost the acknowledgement of a refused group sends it again; each refusal took one group off
    its in-flight count, so the second took another group's place (which the ingest then granted again)."""
    _, control, stub = ingest
    assert stub.Admit(rollout_pb2.AdmitRequest(sampler_id="sampler-0", groups=3, policy_version=0)).granted == 3
    bad = group(1)
    del bad.completions[1]
    for _ in range(2):
        assert [a.code for a in acks(stub, bad)] == [INVALID]
    good = group(2)
    for _ in range(2):  # an accepted one sent again is a duplicate: counted once too
        assert [a.code for a in acks(stub, good)] == [0]
    assert control.in_flight() == {"sampler-0": 1}
