"""The ingest as a trust boundary, on a real gRPC server with a real Redis: a group id must be exactly the one its
sampler makes, and damaged Redis contents end a sampler's stream with the reason instead of a retry loop."""

import grpc
import pytest

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.client.prompts import PromptClient
from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS, ClientSecurity
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc
from grpo_stream.sampler_service.rollout_client import RolloutClient
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer
from tests.integration.test_auth import dataset_group
from tests.support import answer, serve, wait_for, with_run_name
from tests.trainer_stack import LIMITS, group

pytestmark = pytest.mark.redis


def test_one_data_position_under_two_group_ids_is_refused(per_sampler_stack):
    """The id was checked by its tail ('/<sampler>/<position>'), so 'x/<sampler>/<p>' beside '<run>/<sampler>/<p>'
    were two groups for one data position, both appended (the buffer de-duplicates by id) and both trained."""
    run = per_sampler_stack.cfg.run.name
    stub = rollout_pb2_grpc.RolloutIngestStub(per_sampler_stack.channel(None, per_sampler_stack.token("sampler-0")))
    assert stub.PushGroup(dataset_group(run, "sampler-0", 5)).code == 0
    for other_run in ("x", f"{run}/x", ""):
        twin = dataset_group(other_run, "sampler-0", 5)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.StreamBatches(iter([rollout_pb2.RolloutBatch(groups=[twin])])))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, other_run
        assert "groups[0].group_id" in err.value.details() and f"'{run}/sampler-0/5'" in err.value.details()
        assert "run.name" in err.value.details()
    assert per_sampler_stack.buffer.counters()["ingested"] == 1


@pytest.fixture
def open_stack(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as stack:
        yield stack


def test_a_damaged_buffer_key_stops_the_sender_with_the_key_and_the_fix(open_stack):
    """The append script refuses a damaged key (DAMAGEDBUFFER, naming it and the fix); that escaped the ingest as
    UNKNOWN, which the sender retries as passing: for ever, logging only 'StatusCode.UNKNOWN'."""
    buffer = open_stack.buffer
    buffer.client.hset(buffer.k["counters"], "ingested", "x")
    channel = open_stack.channel("sampler")
    client = RolloutClient(channel, backlog_max_groups=4).start()
    try:
        assert client.put(dataset_group(open_stack.cfg.run.name, "sampler-0", 1), timeout_s=5)
        wait_for(lambda: client.error is not None, 20, "the sender to stop on the damaged buffer")
        message = str(client.error)
        assert "FAILED_PRECONDITION" in message and f"{buffer.k['counters']} field ingested" in message
        assert f"HSET {buffer.k['counters']} ingested N" in message
        assert client.stats["reconnects"] == 0
    finally:
        client.close()
        channel.close()
    assert buffer.depth() == 0


def test_an_answer_whose_prompt_key_is_damaged_is_refused_alone(open_stack):
    """A prompt key of another type failed the prompt records' read WRONGTYPE: the whole batch escaped as UNKNOWN and
    was sent again for ever. Now that answer alone is refused, naming the prompt; the dataset group beside it is
    appended."""
    cfg, buffer = open_stack.cfg, open_stack.buffer
    stub = rollout_pb2_grpc.RolloutIngestStub(open_stack.channel("sampler"))
    damaged = rollout_pb2.InjectedPrompt(prompt_id="p-damaged", prompt_token_ids=[3, 4],
                                         num_generations=cfg.generation.num_generations)
    buffer.client.set(f"{buffer.base}:prompt:p-damaged", "not a hash")
    batch = rollout_pb2.RolloutBatch(groups=[dataset_group(cfg.run.name, "sampler-0", 1),
                                             to_proto(answer(damaged, cfg.run.name))])
    (reply,) = stub.StreamBatches(iter([batch]))
    assert [a.code for a in reply.acks] == [0, grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    assert reply.acks[1].message.startswith("prompt_id: the Redis key of injected prompt 'p-damaged' is not a hash")
    assert buffer.depth() == 1


def test_groups_left_unacknowledged_when_the_sender_stops_are_counted(shared_redis, run_name):
    """A sampler stopping while the buffer is full drains for a while, then closes: the groups still held were lost
    with only 'backlog drained: False' said. They are counted (stats['unsent']) and logged."""
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    server = TrainerServer(IngestServicer(buffer, LIMITS, max_groups=2, retry_after_ms=20), WeightPublisher(),
                           "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}", options=CHANNEL_OPTIONS)
    client = RolloutClient(channel, backlog_max_groups=8).start()
    try:
        for i in range(5):
            assert client.put(to_proto(group(i)), timeout_s=5)
        wait_for(lambda: client.stats["accepted"] == 2 and client.stats["retried"] > 0, 20, "the buffer to fill")
        assert not client.drain(0.2)
    finally:
        client.close()
        channel.close()
        server.stop(0)
    assert client.stats["unsent"] == 3 and buffer.depth() == 2
    client.close()  # closing again counts nothing twice
    assert client.stats["unsent"] == 3


def test_an_answer_carrying_a_data_position_is_refused_and_moves_no_sampler_position(open_stack):
    """An injected answer with a data_position was appended with it: the sampler's recorded position jumped there (a
    restarted sampler resumed at 10**13, skipping its whole data stream), and one at or below the compacted position
    was acknowledged as a duplicate and never recorded as the prompt's answer."""
    stack = open_stack
    run = stack.cfg.run.name
    client = PromptClient(stack.address, ClientSecurity(stack.token("client")))
    stub = rollout_pb2_grpc.RolloutIngestStub(stack.channel("sampler"))
    [pid] = client.submit([{"text": "Q: x A:", "answer": "1", "train": True}])
    [prompt] = stub.ClaimPrompts(rollout_pb2.ClaimRequest(sampler_id="sampler-0", max_prompts=4)).prompts
    wrong = to_proto(answer(prompt, run))
    wrong.data_position = 10**13
    with pytest.raises(grpc.RpcError) as err:
        stub.PushGroup(wrong)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("data_position: 10000000000000 set on an injected prompt's answer")
    position = stub.GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id="sampler-0"))
    assert not position.known and list(position.unanswered) == []
    assert stack.buffer.depth() == 0
    # the prompt still waits for its answer, which is taken as sent without one
    assert stub.PushGroup(to_proto(answer(prompt, run))).code == 0
    [result] = client.results([pid], timeout_s=30)
    assert result.state == "done" and stack.buffer.depth() == 1


def test_a_sampler_of_another_run_name_is_stopped_without_auth_too(shared_redis, run_name):
    """Without auth (or under an admin token) group ids were not checked, so a sampler whose run.name differed from
    the ingest's had its groups accepted under '<other run>/<sampler>/<position>'; GetDataPosition, which looks for
    '<run>/<sampler>/<position>', then reported every one of them unanswered, and the restarted sampler generated
    them all again, each answered as a duplicate. Now the stream ends naming the field and run.name."""
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    server = TrainerServer(IngestServicer(buffer, LIMITS, max_groups=8, retry_after_ms=20), WeightPublisher(),
                           "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}", options=CHANNEL_OPTIONS)
    try:
        stub = rollout_pb2_grpc.RolloutIngestStub(channel)
        mine = to_proto(group(1))
        mine.group_id = f"{run_name}/{mine.sampler_id}/1"
        assert stub.PushGroup(mine).code == 0
        for other_run in ("other", ""):
            twin = to_proto(group(2))
            twin.group_id = f"{other_run}/{twin.sampler_id}/2"
            with pytest.raises(grpc.RpcError) as err:
                list(stub.StreamBatches(iter([rollout_pb2.RolloutBatch(groups=[mine, twin])])))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, other_run
            details = err.value.details()
            assert details.startswith("groups[1].group_id: ") and f"'{run_name}/sampler-0/2'" in details
            assert "run.name" in details
        assert buffer.counters()["ingested"] == 1
        position = stub.GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id="sampler-0"))
        assert position.position == 1 and list(position.unanswered) == [0]
    finally:
        channel.close()
        server.stop(0)
