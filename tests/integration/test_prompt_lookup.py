"""Looking up injected prompts by id on a real PromptService with a real Redis: an unknown id is NOT_FOUND naming the
field, and a prompt key that something else wrote is FAILED_PRECONDITION naming it (never UNKNOWN)."""

import grpc
import pytest

from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc
from tests.support import serve, with_run_name

pytestmark = pytest.mark.redis


@pytest.fixture
def stack(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as s:
        yield s


def refusal(call) -> grpc.RpcError:
    """The error `call` (a stream, or a list of one reply) ends with."""
    with pytest.raises(grpc.RpcError) as err:
        list(call())
    return err.value


def test_an_unknown_prompt_id_is_not_found_when_followed_or_looked_up(stack):
    stub = prompts_pb2_grpc.PromptServiceStub(stack.channel("client"))
    for follow in (False, True):
        for ids in (["p-nope"], ["", "p-nope"]):
            err = refusal(lambda: stub.StreamResults(prompts_pb2.ResultsRequest(prompt_ids=ids, follow=follow)))
            assert err.code() == grpc.StatusCode.NOT_FOUND, (follow, ids)
            assert err.details().startswith("prompt_ids[0]: no prompt") and "result_retention_s" in err.details()
    err = refusal(lambda: [stub.Cancel(prompts_pb2.CancelRequest(prompt_ids=["p-nope"]))])
    assert err.code() == grpc.StatusCode.NOT_FOUND and "p-nope" in err.details()


def test_a_prompt_key_of_another_type_is_named_not_unknown(stack):
    """A prompt key that something other than grpo-stream wrote (a string) failed the lookup WRONGTYPE: UNKNOWN."""
    buffer = stack.buffer
    buffer.client.set(f"{buffer.base}:prompt:p-foreign", "not a hash")
    stub = prompts_pb2_grpc.PromptServiceStub(stack.channel("admin"))
    calls = {"follow": lambda: stub.StreamResults(prompts_pb2.ResultsRequest(prompt_ids=["p-foreign"])),
             "cancel": lambda: [stub.Cancel(prompts_pb2.CancelRequest(prompt_ids=["p-foreign"]))]}
    for name, call in calls.items():
        err = refusal(call)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (name, err.details())
        assert "'p-foreign'" in err.details() and "delete the key" in err.details(), name
