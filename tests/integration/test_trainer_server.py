"""Ingest and health on a real gRPC server on loopback, with a real Redis (weights: test_trainer_server_weights.py)."""

import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.wire import CompletionData, decode_group, to_proto
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc
from grpo_stream.sampler_service.rollout_client import RolloutClient
from grpo_stream.trainer_service.ingest.rollout_ingest import MAX_BATCH_GROUPS, IngestServicer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer
from tests.trainer_stack import LIMITS, group, stack  # noqa: F401 (stack: the fixture)


pytestmark = pytest.mark.redis

def test_health_reports_serving(stack):
    *_, channel = stack
    stub = health_pb2_grpc.HealthStub(channel)
    for service in ("", "grpo_stream.v1.RolloutIngest", "grpo_stream.v1.WeightService"):
        assert stub.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_stream_accepts_groups_and_rejects_a_bad_one_without_closing(stack):
    buffer, ingest, *_, channel = stack
    bad = to_proto(group(1))
    bad.completions[0].logprobs_le = bad.completions[0].logprobs_le[:4]
    batches = [rollout_pb2.RolloutBatch(groups=[to_proto(group(0)), bad]),
               rollout_pb2.RolloutBatch(groups=[to_proto(group(2))])]
    replies = list(rollout_pb2_grpc.RolloutIngestStub(channel).StreamBatches(iter(batches)))
    assert [[a.code for a in r.acks] for r in replies] == [[0, grpc.StatusCode.INVALID_ARGUMENT.value[0]], [0]]
    assert "completions[0].logprobs_le: 1 values for 2 token ids" in replies[0].acks[1].message
    entries = buffer.read(10, 100)
    assert [decode_group(e.payload).group_id for e in entries] == ["g0", "g2"]
    assert ingest.stats["invalid"] == 1


def test_a_batch_of_too_many_groups_is_refused_before_any_work_and_rejections_log_once(stack, caplog):
    """One message may carry millions of 2-byte groups: each would cost validation, a log line and an ack (a reply
    past the message limit). Past MAX_BATCH_GROUPS the stream is refused naming the field; a batch's rejections
    are one log line."""
    buffer, ingest, *_, channel = stack
    stub = rollout_pb2_grpc.RolloutIngestStub(channel)
    flood = rollout_pb2.RolloutBatch(groups=[rollout_pb2.RolloutGroup()] * (MAX_BATCH_GROUPS + 1))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.StreamBatches(iter([flood])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"groups: {MAX_BATCH_GROUPS + 1} groups in one batch, at most {MAX_BATCH_GROUPS}" in err.value.details()
    assert ingest.stats["invalid"] == 0 and buffer.counters()["ingested"] == 0
    with caplog.at_level("WARNING", logger="grpo_stream.trainer_service.ingest.rollout_ingest"):
        (reply,) = stub.StreamBatches(iter([rollout_pb2.RolloutBatch(groups=[rollout_pb2.RolloutGroup()] * 3)]))
    assert len(reply.acks) == 3 and ingest.stats["invalid"] == 3
    lines = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("rejected 3 of 3 groups"), lines


def test_a_batch_larger_than_the_room_left_is_split_in_order(stack):
    """max_groups=4: of a 6-group batch the first 4 are appended, the last 2 are told to retry."""
    buffer, ingest, *_, channel = stack
    batch = rollout_pb2.RolloutBatch(groups=[to_proto(group(i)) for i in range(6)])
    (reply,) = rollout_pb2_grpc.RolloutIngestStub(channel).StreamBatches(iter([batch]))
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert [a.code for a in reply.acks] == [0, 0, 0, 0, exhausted, exhausted]
    assert [a.group_id for a in reply.acks] == [f"g{i}" for i in range(6)]
    assert reply.acks[-1].retry_after_ms == 20 and "buffer.max_groups=4" in reply.acks[-1].message
    assert [decode_group(e.payload).group_id for e in buffer.read(10, 100)] == ["g0", "g1", "g2", "g3"]
    assert buffer.counters()["ingested"] == 4 and ingest.stats["full"] == 2


def test_unary_push_returns_real_status_codes(stack):
    buffer, *_, channel = stack
    stub = rollout_pb2_grpc.RolloutIngestStub(channel)
    bad = to_proto(group(0))
    bad.completions[1].token_ids_le += np.array([7], "<i4").tobytes()
    with pytest.raises(grpc.RpcError) as err:
        stub.PushGroup(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "completions[1].logprobs_le: 2 values for 3 token ids" in err.value.details()
    for i in range(4):
        stub.PushGroup(to_proto(group(i)))
    with pytest.raises(grpc.RpcError) as err:
        stub.PushGroup(to_proto(group(9)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry after" in err.value.details()
    assert buffer.counters()["ingested"] == 4
    # the server is still up
    assert stub.PushGroup.future(to_proto(group(9))).exception() is not None
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status == 1


def test_a_resent_group_is_acknowledged_without_a_second_copy_and_positions_are_served(stack):
    buffer, ingest, *_, channel = stack
    stub = rollout_pb2_grpc.RolloutIngestStub(channel)
    first = to_proto(group(0))
    first.data_position = 41
    assert stub.PushGroup(first).code == 0
    again = stub.PushGroup(first)  # the sender lost the first acknowledgement
    assert again.code == 0 and again.message.startswith("duplicate")
    assert buffer.counters()["ingested"] == 1 and ingest.stats["duplicate"] == 1
    reply = stub.GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id="sampler-0"))
    assert reply.known and reply.position == 41
    assert list(reply.unanswered) == list(range(41))  # group ids not <run>/<sampler>/<position>: none answered
    for position in (7, 44):  # groups as a sampler names them; 44 ends before 42 and 43 (still in flight)
        grouped = to_proto(group(position))
        grouped.group_id, grouped.data_position = f"{buffer.run_name}/sampler-0/{position}", position
        assert stub.PushGroup(grouped).code == 0
    reply = stub.GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id="sampler-0"))
    assert reply.position == 44 and list(reply.unanswered) == [*range(7), *range(8, 44)]
    assert not stub.GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id="sampler-9")).known
    with pytest.raises(grpc.RpcError) as err:
        stub.GetDataPosition(rollout_pb2.DataPositionRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampler_id" in err.value.details()
    bad = to_proto(group(1))
    bad.data_position = -3
    with pytest.raises(grpc.RpcError) as err:
        stub.PushGroup(bad)
    assert "data_position: -3 is negative" in err.value.details()


def test_a_multi_turn_group_is_accepted_with_its_mask_and_a_bad_mask_is_named(stack):
    """Multi-turn completions (model turn, observation tokens the environment wrote, model turn) through the real
    ingest: accepted on the sampler's stream and stored with their model-token mask; a mask that does not fit its
    tokens is refused with INVALID_ARGUMENT naming model_token_mask, and the stream stays open."""
    buffer, ingest, *_, channel = stack
    multi = group(0)
    multi.completions[0] = CompletionData(np.array([3, 4, 30, 31, 5], np.int32),
                                          np.array([-0.5, -1.0, 0.0, 0.0, -0.25], np.float32), 1.0, False,
                                          model_mask=np.array([1, 1, 0, 0, 1], np.bool_))
    bad = to_proto(group(1))
    bad.completions[1].model_token_mask = bytes([1])  # one byte for two tokens
    stub = rollout_pb2_grpc.RolloutIngestStub(channel)
    (reply,) = stub.StreamBatches(iter([rollout_pb2.RolloutBatch(groups=[to_proto(multi), bad])]))
    assert [a.code for a in reply.acks] == [0, grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    assert reply.acks[1].message.startswith("completions[1].model_token_mask: 1 bytes for 2 tokens")
    (stored,) = [decode_group(e.payload) for e in buffer.read(10, 100)]
    assert stored.completions[0].model_mask.tolist() == [True, True, False, False, True]
    assert stored.completions[1].model_mask is None and ingest.stats["invalid"] == 1
    # the unary path: a real gRPC status; an observation token with a logprob is refused too
    bad = to_proto(multi)
    bad.group_id = "g-bad"
    bad.completions[0].logprobs_le = np.array([-0.5, -1.0, -0.3, 0.0, -0.25], "<f4").tobytes()
    with pytest.raises(grpc.RpcError) as err:
        stub.PushGroup(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "completions[0].logprobs_le: observation tokens (model_token_mask 0) must carry logprob exactly 0" in \
        err.value.details()


def test_ingest_answers_unavailable_while_redis_is_down_and_recovers(redis_server):
    from grpo_stream.common.rollouts.redis_server import EmbeddedRedis

    buffer = RedisStreamBuffer(connect(redis_server.url, 5), "outage")
    server = TrainerServer(IngestServicer(buffer, LIMITS, 10, 20), WeightPublisher(), "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}", options=CHANNEL_OPTIONS)
    stub = rollout_pb2_grpc.RolloutIngestStub(channel)
    revived = None
    try:
        assert stub.PushGroup(to_proto(group(0))).code == 0
        redis_server.stop()
        for call in (lambda: stub.PushGroup(to_proto(group(1))),
                     lambda: stub.GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id="sampler-0"))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "retry with backoff" in err.value.details()
        revived = EmbeddedRedis(port=redis_server.port).start()
        assert stub.PushGroup(to_proto(group(1))).code == 0  # same client, reconnected by itself
        assert buffer.counters()["ingested"] == 1  # the revived server is empty (no AOF here): just the new one
    finally:
        channel.close()
        server.stop(0)
        if revived is not None:
            revived.stop()


def test_backpressure_loses_nothing(stack):
    """A producer 3x faster than max_groups: every group arrives once, in order, while a consumer drains."""
    buffer, ingest, *_, channel = stack
    client = RolloutClient(channel, backlog_max_groups=3, max_groups_per_message=3).start()
    seen: list[str] = []
    deadline = time.monotonic() + 60

    def consume():
        while len(seen) < 12 and time.monotonic() < deadline:
            entries = buffer.read(2, 100)
            seen.extend(decode_group(e.payload).group_id for e in entries)
            buffer.settle([(e.entry_id, e.group_id, "trained", 1) for e in entries])
            time.sleep(0.05)  # pacing, not a wait: a consumer slower than the producer keeps the buffer full

    consumer = threading.Thread(target=consume)
    consumer.start()
    for i in range(12):
        while not client.put(to_proto(group(i)), timeout_s=0.5):
            pass
    assert client.drain(10)
    consumer.join(10)
    client.close()
    assert seen == [f"g{i}" for i in range(12)]
    assert ingest.stats["full"] > 0 and client.stats["retried"] > 0
    assert buffer.counters()["ingested"] == 12


def test_fields_a_group_does_not_declare_are_not_stored(stack):
    """protobuf keeps the unknown fields of what it parses and writes them out again: a sender's 1 MiB beside a
    group's declared fields went into the buffer (and into an injected prompt's kept result) unchecked by the
    ingest's limits."""
    buffer, _ingest, *_, channel = stack
    declared = to_proto(group(0))
    raw = declared.SerializeToString() + b"\xc2\x3e" + b"\x80\x80\x40" + b"y" * (1 << 20)  # field 1000, 1 MiB
    smuggled = rollout_pb2.RolloutGroup.FromString(raw)
    assert len(smuggled.SerializeToString()) > 1 << 20  # what a sender puts on the wire
    assert rollout_pb2_grpc.RolloutIngestStub(channel).PushGroup(smuggled).code == 0
    (entry,) = buffer.read(10, 100)
    assert len(entry.payload) == len(declared.SerializeToString())
    assert decode_group(entry.payload).group_id == "g0"
