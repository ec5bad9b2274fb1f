"""Injected prompts' answers at the ingest, on a real gRPC server with a real Redis: what an answer may carry."""

import grpc
import pytest

from grpo_stream.client.prompts import PromptClient
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc
from tests.support import answer, serve, with_run_name

pytestmark = pytest.mark.redis


@pytest.fixture
def stack(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as s:
        yield s


def test_an_answer_carrying_a_data_position_is_refused_and_moves_no_sampler_position(stack):
    """An injected answer with a data_position was appended with it: the sampler's recorded position jumped there (a
    restarted sampler resumed at 10**13, skipping its whole data stream), and one at or below the compacted position
    was acknowledged as a duplicate and never recorded as the prompt's answer."""
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
