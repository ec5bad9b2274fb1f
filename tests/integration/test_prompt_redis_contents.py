"""The prompt queue's records in Redis, which others may write, damaged or foreign, on a real gRPC server with a real
Redis: a damaged queued prompt costs its own answer or claim only, never the batch, the other prompts or the call;
a status record the trainer did not write still answers GetStatus. And the follower and tag edges a client meets:
followers' places free as their calls end, a tag with a trailing newline is refused, an id given twice is one
result."""

import json

import grpc
import numpy as np
import pytest

from grpo_stream.common.rollouts.wire import CompletionData, GroupData, to_proto
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc, rollout_pb2
from grpo_stream.trainer_service.ingest import prompt_service
from tests.integration.test_prompt_service import claim, clients, prompt_stack
from tests.support import answer, wait_for

pytestmark = pytest.mark.redis


@pytest.fixture
def stack(tiny_parts, shared_redis, run_name, tmp_path):
    with prompt_stack(tiny_parts, shared_redis.url, run_name, tmp_path, max_followers=2) as s:
        yield s


def dataset_group(run_name: str, num_generations: int) -> GroupData:
    comps = [CompletionData(np.array([5, 6], np.int32), np.array([-0.1, -0.2], np.float32), 1.0, False)
             for _ in range(num_generations)]
    return GroupData(f"{run_name}/sampler/0", "d0", np.array([3, 4], np.int32), comps, 0, "sampler", data_position=0)


def test_a_damaged_queued_prompt_refuses_its_own_answer_and_the_batch_goes_on(stack):
    client, ingest = clients(stack)
    [pid] = client.submit([{"text": "Q: 1 + 1 A:"}])
    [prompt] = claim(ingest, "sampler")
    queue = stack.server.ingest.injection.queue
    run = stack.cfg.run.name
    for damage in (lambda: queue.client.hset(queue.prompt_key(pid), "req", b"\xff\xff\xff"),
                   lambda: queue.client.hdel(queue.prompt_key(pid), "req")):
        damage()
        batch = rollout_pb2.RolloutBatch(groups=[to_proto(dataset_group(run, stack.cfg.generation.num_generations)),
                                                 to_proto(answer(prompt, run, sampler_id="sampler"))])
        (reply,) = ingest.StreamBatches(iter([batch]), timeout=10)
        assert reply.acks[0].code == 0, reply.acks[0].message  # the dataset group is taken (then a duplicate)
        assert reply.acks[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "prompt_id:" in reply.acks[1].message and "damaged" in reply.acks[1].message
    assert stack.buffer.depth() == 1


def test_a_claimed_prompt_whose_record_names_another_id_is_refused_under_its_own(stack):
    """The claim names each prompt by its key: a record copied from another prompt is cancelled with an error its
    client reads, no hash is made for the id it names, and the good prompts of the claim are handed out."""
    client, ingest = clients(stack)
    ids = client.submit([{"text": "Q: a A:"}, {"text": "Q: b A:"}, {"text": "Q: c A:"}])
    queue = stack.server.ingest.injection.queue
    foreign = rollout_pb2.InjectedPrompt.FromString(queue.client.hget(queue.prompt_key(ids[0]), "req"))
    foreign.prompt_id = "p-elsewhere000000"
    queue.client.hset(queue.prompt_key(ids[1]), "req", foreign.SerializeToString())
    prompts = claim(ingest, "sampler")
    assert [p.prompt_id for p in prompts] == [ids[0], ids[2]]
    assert not queue.client.exists(queue.prompt_key("p-elsewhere000000"))
    [result] = client.results([ids[1]], timeout_s=10)
    assert result.state == "cancelled" and "damaged" in result.error


@pytest.mark.parametrize("record", [
    json.dumps({"step": 5, "samplers": [{"sampler_id": "s0", "installed_version": 4, "queue_depth": 3}]}),
    "not json", json.dumps([1, 2]), json.dumps({"step": "five", "samplers": ["s0", {"sampler_id": "s1"}]})])
def test_get_status_answers_whatever_the_status_record_holds(stack, record):
    """A newer trainer's sampler fields are ignored; what cannot be read is left at its default, never UNKNOWN."""
    queue = stack.server.ingest.injection.queue
    queue.client.set(queue.status_key, record)
    status = prompts_pb2_grpc.PromptServiceStub(stack.channel("client")).GetStatus(prompts_pb2.StatusRequest(),
                                                                                   timeout=10)
    assert status.run_name == stack.cfg.run.name and status.total_steps == stack.cfg.trainer.steps
    if record.startswith('{"step": 5'):
        assert status.trainer_step == 5 and [(s.sampler_id, s.installed_version) for s in status.samplers] == \
            [("s0", 4)]
    else:
        assert status.trainer_step == 0 and status.latest_weight_version == -1
        assert [s.sampler_id for s in status.samplers] == (["s1"] if "s1" in record else [])


def test_a_follower_place_is_free_as_soon_as_its_call_ends(stack, monkeypatch):
    """A follower waiting for results polls Redis (here every 10 s): its place must come back when the client
    leaves, not at its next poll, or a client reconnecting after a cancel is refused though no follower is open."""
    monkeypatch.setattr(prompt_service, "FOLLOW_POLL_MS", 10_000)
    client, _ = clients(stack)
    waiting, done = client.submit([{"text": "Q: a A:"}, {"text": "Q: b A:"}])
    client.cancel([done])
    stub = prompts_pb2_grpc.PromptServiceStub(stack.channel("client"))
    held = [stub.StreamResults(prompts_pb2.ResultsRequest(prompt_ids=[waiting])) for _ in range(2)]

    def served():
        try:
            return [r.prompt_id for r in stub.StreamResults(prompts_pb2.ResultsRequest(prompt_ids=[done]),
                                                            timeout=5)]
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            return None
    wait_for(lambda: served() is None, 5, "a third follower to be refused while two are held")
    for call in held:
        call.cancel()
    assert wait_for(served, 5, "a follower to be served once the held ones were cancelled") == [done]


def test_a_tag_with_a_trailing_newline_is_refused_and_an_id_given_twice_is_one_result(stack):
    client, _ = clients(stack)
    stub = prompts_pb2_grpc.PromptServiceStub(stack.channel("client"))
    with pytest.raises(grpc.RpcError) as err:
        stub.Submit(prompts_pb2.SubmitRequest(prompts=[prompts_pb2.PromptSpec(text="Q: a A:", tags=["ok\n"])]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tags[0]" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.StreamResults(prompts_pb2.ResultsRequest(tag="ok\n"), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tag:" in err.value.details()
    [pid] = client.submit([{"text": "Q: a A:"}])
    client.cancel([pid])
    assert [r.prompt_id for r in client.results([pid, pid], timeout_s=10)] == [pid]


@pytest.mark.parametrize("tags", ["not json", '[1, {"a": 2}, "kept"]'])
def test_an_answer_to_a_prompt_whose_tags_are_damaged_is_recorded_and_its_result_read(stack, tags):
    """The append script finishes an answered prompt after its XADD, and Redis keeps a script's writes up to an
    error: a tags field that is not Submit's JSON list of strings stopped it there (the group in the stream, the
    prompt never finished, its client waiting for good). Damaged tags are now no tags."""
    client, ingest = clients(stack)
    [pid] = client.submit([{"text": "Q: 1 + 1 A:", "tags": ["kept"]}])
    [prompt] = claim(ingest, "sampler")
    queue = stack.server.ingest.injection.queue
    queue.client.hset(queue.prompt_key(pid), "tags", tags)
    batch = rollout_pb2.RolloutBatch(groups=[to_proto(answer(prompt, stack.cfg.run.name, sampler_id="sampler"))])
    (reply,) = ingest.StreamBatches(iter([batch]), timeout=10)
    assert reply.acks[0].code == 0, reply.acks[0].message
    [result] = client.results([pid], timeout_s=10)
    assert result.prompt_id == pid and result.state == "done"
    if "kept" in tags:  # what could be read of them still finds it by tag
        assert [r.prompt_id for r in client.results(tag="kept", follow=False)] == [pid]
