"""PromptService and ClaimPrompts on a real gRPC server with a real Redis: submit, claim in priority order and
shared across samplers, answer, follow, cancel, quotas, validation messages, status."""

import json
import re
import threading
import time

import grpc
import pytest

from grpo_stream.reports.audit import build_audit
from grpo_stream.client.prompts import PromptClient, to_spec
from grpo_stream.common.rpc.grpc_util import ClientSecurity
from grpo_stream.common.rollouts.wire import to_proto
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from grpo_stream.trainer_service.ingest.prompt_service import StatusWriter
from tests.support import FakeClock, answer, serve, with_run_name

pytestmark = pytest.mark.redis


def prompt_stack(tiny_parts, redis_url: str, run_name: str, tmp_path, **prompts):
    """A served stack whose `prompts` section takes `prompts` (a context manager, as `serve`)."""
    cfg, task, tokenizer, _ = tiny_parts
    cfg = cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update=prompts)})
    return serve(with_run_name(cfg, run_name), redis_url, tmp_path / "auth", task, tokenizer)


@pytest.fixture
def stack(tiny_parts, shared_redis, run_name, tmp_path):
    with prompt_stack(tiny_parts, shared_redis.url, run_name, tmp_path, max_pending_per_client=20) as s:
        yield s


def clients(stack):
    c = PromptClient(stack.address, ClientSecurity(stack.token("client")))
    ingest = rollout_pb2_grpc.RolloutIngestStub(stack.channel("sampler"))
    return c, ingest


def claim(ingest, sampler, n=8):
    return list(ingest.ClaimPrompts(rollout_pb2.ClaimRequest(sampler_id=sampler, max_prompts=n)).prompts)


def test_injected_prompts_are_answered_followed_and_only_train_ones_reach_the_trainer(stack):
    client, ingest = clients(stack)
    ids = client.submit([
        {"question": "Tom has 12 apples and gets 30 more. How many apples now?", "answer": "42", "train": True,
         "tags": ["hard"]},
        {"text": "Q: probe A:", "num_generations": 2, "tags": ["probe"]},
    ])
    got = []
    follower = threading.Thread(target=lambda: got.extend(client.results(ids, timeout_s=30)))
    follower.start()
    prompts = claim(ingest, "sampler-0")
    assert [p.prompt_id for p in prompts] == ids
    train, probe = prompts
    assert train.train and train.num_generations == stack.cfg.generation.num_generations
    assert not probe.train and probe.num_generations == 2
    assert stack.server.ingest.limits.num_generations != 2  # the probe's own size is accepted
    # a trainer that logged step 2 published versions up to 4 (the ingest refuses a newer one)
    stack.buffer.log_step("epoch", 2, [])
    for version, prompt in enumerate(prompts, start=3):
        ack = ingest.PushGroup(to_proto(answer(prompt, stack.cfg.run.name, version=version)))
        assert ack.code == 0, ack.message
    follower.join(30)
    by_id = {r.prompt_id: r for r in got}
    assert set(by_id) == set(ids)
    assert by_id[ids[0]].policy_version == 3 and by_id[ids[1]].policy_version == 4
    assert by_id[ids[0]].state == "done" and len(by_id[ids[1]].completions) == 2
    assert by_id[ids[0]].prompt_text.startswith("Q: Tom has 12 apples")
    # only the train=true answer is in the rollout stream; the probe is on the evaluation record
    entries = stack.buffer.client.xrange(stack.buffer.stream)
    assert [f[b"id"].decode() for _, f in entries] == [by_id[ids[0]].group_id]
    assert stack.buffer.client.hexists(stack.buffer.k["audit:eval"], by_id[ids[1]].group_id)
    # a resent answer is a duplicate; tag queries find past results
    again = ingest.PushGroup(to_proto(answer(train, stack.cfg.run.name, version=3)))
    assert again.code == 0 and "duplicate" in again.message
    assert [r.prompt_id for r in client.results(tag="probe", follow=False)] == [ids[1]]


def test_priority_first_and_shared_across_samplers(stack):
    client, ingest = clients(stack)
    ids = client.submit([{"text": f"Q: p{i} A:", "priority": i % 3} for i in range(8)])
    claim(ingest, "sampler-1", n=0)  # sampler-1 is active (a claim of nothing still counts it)
    first, second = claim(ingest, "sampler-0"), claim(ingest, "sampler-1")
    assert len(first) == 4 and len(second) == 4  # fair share of 8 between two active samplers
    order = [p.prompt_id for p in first + second]
    priorities = [int(ids.index(pid)) % 3 for pid in order]
    assert priorities == sorted(priorities, reverse=True)
    same = [ids.index(pid) for pid in order if ids.index(pid) % 3 == 2]
    assert same == sorted(same)  # first come first served within a priority


def test_an_unanswered_claim_returns_to_the_queue_after_its_lease(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    lease = cfg.prompts.claim_lease_s  # the configured lease, on a clock the test moves instead of waiting it out
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as stack:
        clock = stack.server.ingest.injection.queue.clock = FakeClock()
        client, ingest = clients(stack)
        [pid] = client.submit([{"text": "Q: x A:"}])
        assert [p.prompt_id for p in claim(ingest, "sampler-0")] == [pid]
        clock.advance(lease - 0.01)
        assert claim(ingest, "sampler-1") == []  # still sampler-0's
        clock.advance(0.02)
        assert [p.prompt_id for p in claim(ingest, "sampler-1")] == [pid]
        # the first sampler answers late: the answer counts once and the prompt is not handed out again
        [late] = [p for p in stack.server.ingest.injection.queue.records([pid])]
        prompt = rollout_pb2.InjectedPrompt.FromString(late[b"req"])
        assert ingest.PushGroup(to_proto(answer(prompt, stack.cfg.run.name, "sampler-0"))).code == 0
        assert ingest.PushGroup(to_proto(answer(prompt, stack.cfg.run.name, "sampler-1"))).message.startswith(
            "duplicate")
        clock.advance(lease + 0.01)  # sampler-1's claim expires too: the answered prompt stays done
        assert claim(ingest, "sampler-2") == []
        [result] = client.results([pid])
        assert result.sampler_id == "sampler-0"


def test_a_prompt_no_sampler_answers_is_given_up_after_max_claims_leases(tiny_parts, shared_redis, run_name,
                                                                          tmp_path):
    """A prompt every sampler drops (wider than their groups, an environment failing every episode of it) went back
    to the queue at every lease for ever, its client's quota held and its follower waiting: after
    prompts.max_claims lapses it is finished as cancelled, with an error the follower reads."""
    cfg, task, tokenizer, _ = tiny_parts
    lease, most = cfg.prompts.claim_lease_s, cfg.prompts.max_claims
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as stack:
        clock = stack.server.ingest.injection.queue.clock = FakeClock()
        client, ingest = clients(stack)
        [pid] = client.submit([{"text": "Q: x A:"}])
        for lapse in range(most):
            assert [p.prompt_id for p in claim(ingest, f"sampler-{lapse % 2}")] == [pid]  # claimed, then dropped
            clock.advance(lease + 0.01)
        assert claim(ingest, "sampler-0") == []  # the last lapse gave it up
        [result] = client.results([pid])
        assert result.state == "cancelled" and f"claimed {most} times and never answered" in result.error
        assert "prompts.max_claims" in result.error and f"sampler-{(most - 1) % 2}" in result.error
        queue = stack.server.ingest.injection.queue
        assert queue.client.hgetall(queue.pending) == {b"client": b"0"}  # the client's quota is free again


def test_cancel_discards_the_answer_and_only_the_owner_or_an_admin_may_cancel(stack):
    client, ingest = clients(stack)
    ids = client.submit([{"text": "Q: a A:", "train": True, "answer": "1"}, {"text": "Q: b A:"}])
    [prompt, _] = claim(ingest, "sampler-0")
    other = PromptClient(stack.address, ClientSecurity(stack.token("sampler")))  # a different caller name
    other_stub = prompts_pb2_grpc.PromptServiceStub(stack.channel("admin"))
    with pytest.raises(grpc.RpcError) as err:
        PromptClient(stack.address, ClientSecurity(stack.token("client"))).cancel(["p-nope"])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    other.close()
    reply = client.cancel([ids[0], ids[0]])  # an id given twice is cancelled once, and said so once
    assert list(reply.cancelled) == [ids[0]] and list(reply.finished) == []
    ack = ingest.PushGroup(to_proto(answer(prompt, stack.cfg.run.name)))
    assert ack.code == 0 and "cancelled" in ack.message
    assert stack.buffer.client.xlen(stack.buffer.stream) == 0  # a cancelled train=true answer is never trained
    [result] = client.results([ids[0]])
    assert result.state == "cancelled" and result.policy_version == -1
    assert list(other_stub.Cancel(prompts_pb2.CancelRequest(prompt_ids=[ids[1]])).cancelled) == [ids[1]]
    assert list(client.cancel([ids[0]]).finished) == [ids[0]]



def test_finished_prompts_beyond_max_kept_results_leave_redis_oldest_first(tiny_parts, shared_redis, run_name,
                                                                           tmp_path):
    """The soak's Redis grew ~2.3 KB per answered prompt under a week's retention; with a count bound the oldest
    finished prompts leave, with their tag memberships and evaluation records, and Redis stays flat."""
    cfg, task, tokenizer, _ = tiny_parts
    cfg = cfg.model_copy(update={"prompts": cfg.prompts.model_copy(update={"max_kept_results": 3,
                                                                           "max_injected_fraction": 1.0})})
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "auth", task, tokenizer) as stack:
        client, ingest = clients(stack)
        ids = client.submit([{"text": f"Q: {i} A:", "tags": ["probe"]} for i in range(4)]
                            + [{"text": "Q: t A:", "train": True, "answer": "1", "tags": ["probe"]},
                               {"text": "Q: c A:", "tags": ["probe"]}])
        prompts = {p.prompt_id: p for p in claim(ingest, "sampler-0", n=6)}
        for pid in ids[:5]:  # answered in submission order; the last is cancelled, which finishes it too
            assert ingest.PushGroup(to_proto(answer(prompts[pid], stack.cfg.run.name))).code == 0
        assert list(client.cancel([ids[5]]).cancelled) == [ids[5]]
        r, base = stack.buffer.client, stack.buffer.base
        kept = ids[3:]
        assert sorted(k.decode().rsplit(":", 1)[1] for k in r.keys(f"{base}:prompt:*")) == sorted(kept)
        assert sorted(m.decode() for m in r.smembers(f"{base}:tag:probe")) == sorted(kept)
        assert sorted(k.decode() for k in r.hkeys(f"{base}:inject:finished-tags")) == sorted(kept)
        assert [r.prompt_id for r in client.results(tag="probe", follow=False)] == kept
        with pytest.raises(grpc.RpcError) as err:
            list(client.results([ids[0]]))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "max_kept_results" in err.value.details()
        # the train=false answers that left took their evaluation records along; the audit still counts them
        evaluated = {k.decode() for k in r.hkeys(stack.buffer.k["audit:eval"])}
        assert evaluated == {f"{stack.cfg.run.name}/inj/{ids[3]}"}
        report = build_audit(r, stack.cfg.run.name)
        assert report["injected"]["evaluation_only"] == 4 and report["injected"]["evaluation_only_released"] == 3
        # the train=true answer is in the rollout stream still: leaving the prompt records never touches training
        assert [f[b"id"].decode() for _, f in r.xrange(stack.buffer.stream)] == [f"{stack.cfg.run.name}/inj/{ids[4]}"]

def test_cancelling_another_clients_prompt_is_permission_denied(tiny_parts, shared_redis, run_name, tmp_path):
    cfg, task, tokenizer, _ = tiny_parts
    cfg = with_run_name(cfg, run_name)
    with serve(cfg, shared_redis.url, tmp_path / "auth", task, tokenizer) as stack:
        table = stack.tokens["table"]
        rows = table.read_text() + "- {name: alice, role: client, token: alice-token-0123456789}\n"
        table.write_text(rows)
    cfg = cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"tokens_file": str(table)})})
    with serve(cfg, shared_redis.url, tmp_path / "auth2", task, tokenizer) as stack:
        mine = PromptClient(stack.address, ClientSecurity(table.parent.joinpath("client.token").read_text().strip()))
        alice = PromptClient(stack.address, ClientSecurity("alice-token-0123456789"))
        [pid] = mine.submit([{"text": "Q: mine A:"}])
        with pytest.raises(grpc.RpcError) as err:
            alice.cancel([pid])
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "another client" in err.value.details()


def test_quota_and_queue_limits_answer_resource_exhausted_with_a_retry_hint(stack):
    client, _ = clients(stack)
    client.submit([{"text": f"Q: {i} A:"} for i in range(20)])
    with pytest.raises(grpc.RpcError) as err:
        client.submit([{"text": "Q: one more A:"}], retry_s=0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_pending_per_client=20" in err.value.details()
    assert dict(err.value.trailing_metadata())["retry-after-ms"] == "1000"


@pytest.mark.parametrize("spec, field", [
    ({}, "prompts[0]: give `text`"),
    ({"text": " "}, "prompts[0].text: must not be empty"),
    ({"text": "Q: 1 + 1 = ? " * 40}, "prompts[0].text:"),
    ({"text": "x", "priority": 10}, "prompts[0].priority: 10 outside 0..9"),
    ({"text": "x", "priority": -1}, "prompts[0].priority"),
    ({"text": "x", "num_generations": 65}, "prompts[0].num_generations: 65 outside 0..64"),
    ({"text": "x", "train": True}, "prompts[0].reference_answer: required"),
    ({"text": "x", "train": True, "answer": "1", "num_generations": 2}, "generation.num_generations=4"),
    # the run's answer_correct compares numbers: a reference that is none scored every completion 0, silently
    ({"text": "x", "train": True, "answer": "forty-two"}, "prompts[0].reference_answer: 'forty-two' is not a number, "
     "and answer_correct compare"),
    ({"text": "x", "answer": "1e+20", "rewards": ["last_number"]}, "prompts[0].reference_answer: '1e+20' is not a "
     "number, and last_number compare"),
    ({"text": "x", "tags": ["a b"]}, "prompts[0].tags[0]"),
    ({"text": "x", "tags": ["t" * 65]}, "prompts[0].tags[0]: 65 characters, must be 1..64"),
    ({"text": "x", "tags": [f"t{i}" for i in range(9)]}, "prompts[0].tags: 9 tags, limit 8"),
    # the run's rewards follow, in order (the built-ins grow as tasks are added)
    ({"text": "x", "rewards": ["answer_format", "os:system"]}, "prompts[0].rewards[1]: 'os:system' is not one of this "
     "run's rewards ['answer_correct', 'answer_format', "),
    # lm-eval's IFEval checks run on what the client sent: only an IFEval run offers them
    ({"text": "x", "rewards": ["ifeval_strict"]}, "prompts[0].rewards[0]: 'ifeval_strict' is not one of this run's "
     "rewards ['answer_correct', 'answer_format', 'last_number', 'reasoning_answer_format']"),
])
def test_invalid_prompts_name_the_field_and_limit(stack, spec, field):
    stub = prompts_pb2_grpc.PromptServiceStub(stack.channel("client"))
    request = prompts_pb2.SubmitRequest(prompts=[prompts_pb2.PromptSpec(**{
        "reference_answer" if k == "answer" else k: v for k, v in spec.items()})])
    with pytest.raises(grpc.RpcError) as err:
        stub.Submit(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details(), err.value.details()
    assert stack.buffer.client.zcard(f"grpo-stream:{stack.cfg.run.name}:inject:queue") == 0


def test_non_utf8_strings_are_invalid_argument_naming_the_field(stack):
    channel = stack.channel("client")
    raw = channel.unary_unary("/grpo_stream.v1.PromptService/Submit", request_serializer=lambda b: b,
                              response_deserializer=lambda b: b)
    good = prompts_pb2.SubmitRequest(prompts=[prompts_pb2.PromptSpec(text="Q: ok A:", tags=["zz"])]).SerializeToString()
    with pytest.raises(grpc.RpcError) as err:
        raw(good.replace(b"zz", b"\xff\xfe"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompts[0].tags[0]: not valid UTF-8")


def test_status_reports_trainer_samplers_buffer_and_queue(stack):
    client, ingest = clients(stack)
    client.submit([{"text": "Q: a A:"}, {"text": "Q: b A:"}])
    claim(ingest, "sampler-0", n=1)
    stack.publisher.samplers.record("sampler-0", 0, throughput=(2.5, 40.0))
    writer = StatusWriter(stack.server.ingest.injection.queue, stack.publisher, total_steps=7)
    writer.step = 3
    writer.write()
    status = client.status()
    assert (status.trainer_step, status.total_steps, status.latest_weight_version) == (3, 7, 0)
    assert (status.injection_queued, status.injection_claimed, status.buffer_depth) == (1, 1, 0)
    [s] = status.samplers
    assert (s.sampler_id, s.installed_version, s.lag, s.groups_per_s, s.tokens_per_s) == ("sampler-0", 0, 0, 2.5, 40.0)
    assert time.time() - status.trainer_updated_unix < 5
    assert json.loads(stack.buffer.client.get(f"grpo-stream:{stack.cfg.run.name}:status"))["step"] == 3


def test_the_status_command_says_how_old_the_status_is(stack, tmp_path, capsys):
    """The status key outlives the trainer: without its age a dead trainer's last step read as the run's now."""
    from grpo_stream.cli import main

    client, _ = clients(stack)
    stack.publisher.samplers.record("sampler-0", 0, throughput=(2.5, 40.0))
    writer = StatusWriter(stack.server.ingest.injection.queue, stack.publisher, total_steps=7)
    writer.write()
    token = tmp_path / "client.token"
    token.write_text(stack.token("client"))
    assert main(["status", "--address", stack.address, "--token-file", str(token)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert 0 <= printed["trainer_status_age_s"] < 5 and 0 <= printed["samplers"][0]["last_seen_s_ago"] < 5


def test_reflection_lists_and_describes_every_service_as_grpcurl_would(stack):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    db = ProtoReflectionDescriptorDatabase(stack.channel("admin"))  # reflection is for admins (grpcurl list)
    assert {"grpo_stream.v1.PromptService", "grpo_stream.v1.RolloutIngest", "grpo_stream.v1.WeightService",
            "grpc.health.v1.Health"} <= set(db.get_services())
    service = DescriptorPool(db).FindServiceByName("grpo_stream.v1.PromptService")
    assert [m.name for m in service.methods] == ["Submit", "StreamResults", "Cancel", "GetStatus"]
    assert service.methods_by_name["Submit"].input_type.fields_by_name["prompts"].message_type.full_name == \
        "grpo_stream.v1.PromptSpec"


def test_messages_over_the_size_limit_are_refused_and_the_server_stays_up(stack):
    from grpo_stream.common.rpc.grpc_util import MAX_MESSAGE_BYTES

    big = grpc.insecure_channel(stack.address, options=[("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)])
    raw = big.unary_unary("/grpo_stream.v1.PromptService/Submit", request_serializer=lambda b: b,
                          response_deserializer=lambda b: b)
    oversized = prompts_pb2.SubmitRequest(prompts=[prompts_pb2.PromptSpec(text="x" * (MAX_MESSAGE_BYTES + 1024))])
    with pytest.raises(grpc.RpcError) as err:
        raw(oversized.SerializeToString(), metadata=[("authorization", f"Bearer {stack.token('client')}")], timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    big.close()
    # and the client side refuses to send one at all
    client, _ = clients(stack)
    with pytest.raises(grpc.RpcError) as err:
        client.submit([prompts_pb2.PromptSpec(text="x" * (MAX_MESSAGE_BYTES + 1024))], retry_s=0)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.status().run_name == stack.cfg.run.name


def test_a_submit_that_fails_part_way_prints_the_ids_it_queued_and_the_line_to_resume_from(stack, tmp_path, capsys):
    """`grpo-stream submit` sends a file in calls of --batch prompts: when a later call fails, the prompts of the
    calls before are queued, so their ids are printed (a rerun of the whole file would queue them twice)."""
    from grpo_stream.cli import main

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"text": "Q: 1 + 1 A:"}\n\n{"text": "Q: 2 + 2 A:"}\n{"text": "Q: 3 + 3 A:", "priority": 50}\n')
    token = tmp_path / "client.token"
    token.write_text(stack.token("client"))
    # a refused prompt is input the command cannot use: exit 2 (the CLI's policy, grpo_stream/cli.py)
    assert main(["submit", str(path), "--batch", "2", "--address", stack.address, "--token-file", str(token)]) == 2
    out, err = capsys.readouterr()
    printed = json.loads(out)
    assert len(printed["prompt_ids"]) == 2 and not printed["complete"] and printed["failed_from_line"] == 4
    assert "the 2 prompts before line 4" in err and f"{path}:4: priority: 50 outside 0..9" in err
    client, _ = clients(stack)
    assert sorted(client.cancel(printed["prompt_ids"]).cancelled) == sorted(printed["prompt_ids"])  # they were queued


@pytest.mark.parametrize("item, message", [
    ({"text": "x", "train": "false"}, "prompt.train: 'false' is a str; give a bool"),
    ({"text": "x", "tags": "probe"}, "prompt.tags: 'probe' is a str; give a list"),
    ({"text": "x", "rewards": ["answer_correct", 3]}, "prompt.rewards: give a list of strings"),
    ({"text": "x", "num_generations": True}, "prompt.num_generations: True is a bool; give a int"),
    ({"text": "x", "answer": None, "train": True}, "prompt.answer: None is a NoneType"),
])
def test_a_mistyped_prompt_is_refused_by_the_client_not_coerced(item, message):
    """"false" would have been train=True and None the reference answer "None"."""
    with pytest.raises(ValueError, match=re.escape(message)):
        to_spec(item)


def test_following_a_tag_streams_a_prompt_that_finishes_as_the_call_starts_once(stack, monkeypatch):
    """A prompt finishing after the call read the results' tail and before it read the tag's prompts is among the
    finished ones and in the tail: it was streamed twice, and followers that count results counted it twice."""
    from grpo_stream.trainer_service.ingest.prompt_queue import PromptQueue

    client, _ = clients(stack)
    [pid] = client.submit([{"text": "Q: 1 + 1 A:", "tags": ["probe"]}])
    tagged = PromptQueue.tagged

    def finishes_first(queue, tag):  # the prompt finishes (cancelled here: the same path as an answer) just then
        client.cancel([pid])
        return tagged(queue, tag)
    monkeypatch.setattr(PromptQueue, "tagged", finishes_first)
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for result in client.results(tag="probe", follow=True, timeout_s=3):
            got.append((result.prompt_id, result.state))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and got == [(pid, "cancelled")]


def test_more_ids_than_allowed_are_refused_by_their_count_before_they_are_read(stack):
    """StreamResults copied and de-duplicated every id before counting them (a 64 MiB request of distinct ids: ~600
    MiB in the server per follower call), and Cancel copied them before checking prompts.max_batch: the count given
    is refused first, whatever the ids (here all the same, which the copy made one)."""
    from grpo_stream.trainer_service.ingest.prompt_service import MAX_IDS

    client, _ = clients(stack)
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.StreamResults(prompts_pb2.ResultsRequest(prompt_ids=["p"] * (MAX_IDS + 1)), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == f"prompt_ids: {MAX_IDS + 1} given, limit {MAX_IDS}"
    too_many = stack.cfg.prompts.max_batch + 1
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Cancel(prompts_pb2.CancelRequest(prompt_ids=["p"] * too_many), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"{too_many} given" in err.value.details()
