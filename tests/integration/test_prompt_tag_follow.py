"""Following a tag that other clients use too: the follower gets its own prompts' results, never theirs, and is not
refused for starting before its own first prompt carries the tag (tags are one namespace for every client: the docs'
examples all use `probe`)."""

import threading

import grpc
import pytest

from grpo_stream.client.prompts import PromptClient
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from tests.support import answer, serve, with_run_name

pytestmark = pytest.mark.redis
ALICE = "alice-token-0123456789"


@pytest.fixture
def two_clients(tiny_parts, shared_redis, run_name, tmp_path):
    """A server whose token table has a second client, alice, beside the default client (bob here)."""
    from grpo_stream.common.rpc.auth import write_tokens  # noqa: PLC0415

    cfg, task, tokenizer, _ = tiny_parts
    paths = write_tokens(tmp_path / "table")
    paths["table"].write_text(paths["table"].read_text() + f"- {{name: alice, role: client, token: {ALICE}}}\n")
    cfg = with_run_name(cfg, run_name)
    cfg = cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"tokens_file": str(paths["table"])})})
    with serve(cfg, shared_redis.url, tmp_path / "unused", task, tokenizer) as stack:
        stack.tokens = paths
        yield stack


def answer_all(stack, expected: int) -> None:
    sampler = rollout_pb2_grpc.RolloutIngestStub(stack.channel("sampler"))
    claimed = sampler.ClaimPrompts(rollout_pb2.ClaimRequest(sampler_id="sampler-0", max_prompts=8)).prompts
    assert len(claimed) == expected
    for prompt in claimed:
        assert sampler.PushGroup(to_proto(answer(prompt, stack.cfg.run.name))).code == 0


def test_following_a_tag_before_submitting_to_it_is_not_refused_for_other_clients_use(two_clients):
    """A follower started before its client's first prompt with the tag (`results --tag probe --follow`, then
    `submit`), or one reconnecting after its own tagged prompts left Redis, found only other clients' prompts under
    the tag and was refused PERMISSION_DENIED, which ends the command (exit 2): one client's use of a tag name stopped
    every other client from following it. It waits for its own prompts instead, and never sees the others'."""
    stack = two_clients
    bob = PromptClient(stack.address, ClientSecurity(stack.token("client")))
    alice = PromptClient(stack.address, ClientSecurity(ALICE))
    bob.submit([{"text": "Q: bob A:", "tags": ["probe"]}])
    queue = stack.server.ingest.injection.queue  # the PromptService's queue too (ingest_servicers)
    read_tag, tagged = threading.Event(), queue.tagged

    def tagged_then_say_so(tag):
        try:
            return tagged(tag)
        finally:
            read_tag.set()
    queue.tagged = tagged_then_say_so  # the follower has read who uses the tag: alice's prompt comes after
    got, failed = [], []

    def follow():
        try:
            for result in alice.results(tag="probe", follow=True, timeout_s=30):
                got.append(result)
                return
        except grpc.RpcError as exc:
            failed.append(exc)
    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    assert read_tag.wait(10), "the follower never read the tag's prompts"
    [mine] = alice.submit([{"text": "Q: alice A:", "tags": ["probe"]}])
    answer_all(stack, 2)
    follower.join(30)
    assert not failed, failed[0].details()
    assert [r.prompt_id for r in got] == [mine]
    assert got[0].prompt_text == "Q: alice A:"


def test_a_one_shot_query_of_a_tag_only_other_clients_carry_still_says_so(two_clients):
    """Without follow, nothing would ever be streamed: the refusal explains the empty answer (docs/security.md)."""
    stack = two_clients
    PromptClient(stack.address, ClientSecurity(stack.token("client"))).submit([{"text": "Q: b A:", "tags": ["own"]}])
    stub = prompts_pb2_grpc.PromptServiceStub(stack.channel(None, ALICE))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.StreamResults(prompts_pb2.ResultsRequest(tag="own", follow=False), timeout=10))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "other clients" in err.value.details()
