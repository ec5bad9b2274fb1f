"""Admission control on a real gRPC ingest with a real Redis buffer, asked by the sampler's AdmissionClient."""

import threading

import grpc
import numpy as np
import pytest

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rollouts.redis_server import connect
from grpo_stream.common.rollouts.wire import CompletionData, GroupData, GroupLimits, to_proto
from grpo_stream.common.rpc.auth import write_tokens
from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc
from grpo_stream.sampler_service.admission_client import AdmissionClient
from grpo_stream.trainer_service.ingest.admission import AdmissionControl, AdmissionLimits
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer
from tests.support import serve, with_run_name

pytestmark = pytest.mark.redis
LIMITS = GroupLimits(num_generations=2, max_prompt_tokens=8, max_new_tokens=6, vocab_size=50)
GROUPS_PER_STEP, MAX_STALENESS = 4, 1  # room for (1 + 1) * 4 = 8 groups of the trainer's current version


def group(i: int, sampler: str, version: int = 0):
    comps = [CompletionData(np.array([3, 4], np.int32), np.array([-0.5, -1.0], np.float32), float(j), False)
             for j in range(2)]
    return to_proto(GroupData(f"{sampler}/g{i}", f"p{i}", np.array([1, 2], np.int32), comps, version, sampler,
                              data_position=i))


@pytest.fixture
def ingest(shared_redis, run_name):
    buffer = RedisStreamBuffer(connect(shared_redis.url, 5), run_name)
    control = AdmissionControl(AdmissionLimits(GROUPS_PER_STEP, MAX_STALENESS, steps=3))
    server = TrainerServer(IngestServicer(buffer, LIMITS, 100, 20, admission=control), WeightPublisher(),
                           "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}", options=CHANNEL_OPTIONS)
    try:
        yield buffer, rollout_pb2_grpc.RolloutIngestStub(channel)
    finally:
        channel.close()
        server.stop(0)


def test_grants_follow_the_trainers_steps_and_stop_at_its_last(ingest):
    buffer, stub = ingest
    a = AdmissionClient(stub, "sampler-0", True, threading.Event())
    b = AdmissionClient(stub, "sampler-1", True, threading.Event())
    assert a.admit(6, version=0, in_flight=0) == 6
    assert b.admit(6, version=0, in_flight=0) == 2  # sampler-0's 6 in flight are ahead
    assert b.admit(6, version=0, in_flight=2) == 0 and b.refusals == 1 and b.waited_s > 0
    for i in range(6):  # sampler-0's groups arrive: the buffer holds them now, so still no room
        assert stub.PushGroup(group(i, "sampler-0")).code == 0
    assert b.admit(6, version=0, in_flight=2) == 0
    # the trainer trains step 1 (4 groups, version 0) and publishes version 1
    entries = buffer.read(4, block_ms=100)
    buffer.settle([(e.entry_id, e.group_id, "trained", 1) for e in entries])
    buffer.log_step("epoch", 1, [e.group_id for e in entries])
    assert b.admit(6, version=0, in_flight=2) == 0  # version 0 is now one behind: nothing more of it fits
    # while sampler-1's version-0 groups are in flight, version-1 groups could overtake them: none are admitted
    assert b.admit(6, version=1, in_flight=2) == 0
    for i in range(2):
        assert stub.PushGroup(group(i, "sampler-1")).code == 0
    assert b.admit(6, version=1, in_flight=0) == 4  # 4 waiting + 4 = two steps' worth of version 1
    reply = stub.Admit(rollout_pb2.AdmitRequest(sampler_id="sampler-1", groups=6, policy_version=1, in_flight=4))
    assert (reply.granted, reply.trainer_step, reply.queued, reply.retry_after_ms) == (0, 1, 8, 100)
    # two more steps end the run (trainer.steps=3): nothing is admitted after the last one
    entries = buffer.read(8, block_ms=100)
    buffer.settle([(e.entry_id, e.group_id, "trained", 3) for e in entries])
    buffer.log_step("epoch", 3, [])
    assert a.admit(6, version=3, in_flight=0) == 0


def test_a_resent_group_is_counted_answered_once(ingest):
    """A sampler whose acknowledgement was lost sends the group again and hears 'duplicate': that group was counted
    answered when it first arrived, so the resend must not take another of the sampler's groups off its count (a
    report only lowers a count: the undercount stayed, and the ingest granted past the staleness bound)."""
    buffer, stub = ingest
    a = AdmissionClient(stub, "sampler-0", True, threading.Event())
    b = AdmissionClient(stub, "sampler-1", True, threading.Event())
    assert a.admit(2, version=0, in_flight=0) == 2
    assert stub.PushGroup(group(0, "sampler-0")).code == 0  # its acknowledgement lost on the way back
    resent = stub.PushGroup(group(0, "sampler-0"))
    assert resent.code == 0 and resent.message.startswith("duplicate")
    # in the buffer 1, at sampler-0 1 (group 1, still decoding): 6 places are left of (1 + 1) * 4, not 7
    assert b.admit(8, version=0, in_flight=0) == 6


def test_a_sampler_process_replaced_by_another_under_its_id_is_refused(ingest):
    """Two running samplers given one index (or token) share a sampler id: their counts, group ids and data
    positions collide. The process that asked last holds the id; the one it replaced, asking again, stops with an
    error saying so. A restart (the old process gone) goes on as before."""
    _, stub = ingest
    stop = threading.Event()
    first = AdmissionClient(stub, "sampler-0", True, stop, process="a1")
    second = AdmissionClient(stub, "sampler-0", True, stop, process="b2")
    assert first.admit(1, version=0, in_flight=0) == 1
    assert second.admit(1, version=0, in_flight=0) == 1  # a restart, or a second sampler: the id is its now
    assert second.admit(1, version=0, in_flight=1) == 1
    with pytest.raises(PermanentError, match="two running samplers must not share a sampler id") as refused:
        first.admit(1, version=0, in_flight=1)
    assert "'sampler-0'" in str(refused.value) and "token (auth.token_file" not in str(refused.value)
    assert second.admit(1, version=0, in_flight=2) == 1  # the one that holds the id goes on


def test_a_stopping_sampler_releases_its_grants_for_the_others(ingest):
    """A sampler that stops holds its grants at the ingest until sampler.admission_lease_s (600 s) passes: where
    they fill the staleness bound every other sampler is refused, and the trainer waits for groups none may start.
    Its release (an Admit for no group, holding none) frees them at once; a replaced process's is refused quietly."""
    _, stub = ingest
    stop = threading.Event()
    a = AdmissionClient(stub, "sampler-0", True, stop, process="a1")
    b = AdmissionClient(stub, "sampler-1", True, stop, process="b1")
    assert a.admit(8, version=0, in_flight=0) == 8  # the whole bound: (1 + 1) * 4 groups
    assert b.admit(4, version=0, in_flight=0) == 0
    assert a.release()
    assert b.admit(4, version=0, in_flight=0) == 4
    assert AdmissionClient(stub, "sampler-0", True, stop, process="a2").admit(1, version=0, in_flight=0) == 1
    assert not a.release()  # replaced by a2: its release counts nothing, and raises nothing
    assert AdmissionClient(stub, "sampler-0", False, stop).release() is False  # admission off: nothing to tell


def test_bad_requests_name_the_field(ingest):
    _, stub = ingest
    for request, field in [(rollout_pb2.AdmitRequest(groups=1), "sampler_id"),
                           (rollout_pb2.AdmitRequest(sampler_id="s", groups=-1), "groups"),
                           (rollout_pb2.AdmitRequest(sampler_id="s", groups=1, in_flight=-3), "in_flight")]:
        with pytest.raises(grpc.RpcError) as err:
            stub.Admit(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


def test_the_sampler_pauses_while_redis_is_down_and_resumes(redis_server):
    from grpo_stream.common.rollouts.redis_server import EmbeddedRedis

    buffer = RedisStreamBuffer(connect(redis_server.url, 5), "admission-outage")
    control = AdmissionControl(AdmissionLimits(GROUPS_PER_STEP, MAX_STALENESS, steps=10))
    server = TrainerServer(IngestServicer(buffer, LIMITS, 100, 20, admission=control), WeightPublisher(),
                           "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.start()}", options=CHANNEL_OPTIONS)
    client = AdmissionClient(rollout_pb2_grpc.RolloutIngestStub(channel), "sampler-0", True, threading.Event())
    revived = None
    try:
        redis_server.stop()
        assert client.admit(4, version=0, in_flight=0) == 0 and client.waited_s >= 0.9  # paused, not generating
        revived = EmbeddedRedis(port=redis_server.port).start()
        assert client.admit(4, version=0, in_flight=0) == 4
    finally:
        channel.close()
        server.stop(0)
        if revived is not None:
            revived.stop()


def test_an_ingest_without_admit_admits_everything():
    """An older ingest (no Admit method): the sampler generates as before instead of waiting forever."""
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(2))
    rollout_pb2_grpc.add_RolloutIngestServicer_to_server(rollout_pb2_grpc.RolloutIngestServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        client = AdmissionClient(rollout_pb2_grpc.RolloutIngestStub(channel), "sampler-0", True, threading.Event())
        assert client.admit(5, version=3, in_flight=2) == 5 and not client.enabled
        assert client.admit(7, version=3, in_flight=2) == 7
    finally:
        channel.close()
        server.stop(0)


@pytest.fixture
def two_tokens(tiny_parts, shared_redis, run_name, tmp_path):
    """A trainer server with auth: sampler-0 and sampler-1 each hold their own token (sampler-1's holder is hostile),
    and admission as a run configures it (groups_per_step 4, max_staleness 1)."""
    cfg, task, tokenizer, _ = tiny_parts
    tokens = write_tokens(tmp_path / "tokens", samplers=2)
    cfg = cfg.model_copy(update={
        "trainer": cfg.trainer.model_copy(update={"groups_per_step": GROUPS_PER_STEP, "max_staleness": MAX_STALENESS,
                                                  "steps": 100}),
        "auth": cfg.auth.model_copy(update={"mode": "tokens", "tokens_file": str(tokens["table"])})})
    with serve(with_run_name(cfg, run_name), shared_redis.url, tmp_path / "unused", task, tokenizer) as stack:
        def stub(name):
            return rollout_pb2_grpc.RolloutIngestStub(stack.channel(None, tokens[name].read_text().strip()))
        yield stack, stub("sampler-1"), AdmissionClient(stub("sampler-0"), "sampler-0", True, threading.Event())


@pytest.mark.parametrize("in_flight,version", [(2**31 - 1, 5), (1, 0), (2**31 - 1, 0), (4096, 4)],
                         ids=["in_flight_max", "version_0", "both", "in_flight_at_an_old_version"])
def test_a_hostile_samplers_reports_stop_only_its_own_grants(two_tokens, in_flight, version):
    stack, hostile, honest = two_tokens
    stack.buffer.log_step("epoch", 5, [])  # the trainer finished step 5: version 5 is current, 0 long stale
    for _ in range(3):  # the lie, repeated (each request would renew a lease of sampler.admission_lease_s)
        hostile.Admit(rollout_pb2.AdmitRequest(sampler_id="sampler-1", groups=0, policy_version=version,
                                               in_flight=in_flight))
    assert honest.admit(4, version=5, in_flight=0) == 4
    # the liar itself is not granted past the bound either: the honest sampler's 4 stay counted
    reply = hostile.Admit(rollout_pb2.AdmitRequest(sampler_id="sampler-1", groups=8, policy_version=5, in_flight=0))
    assert reply.granted == 2 * GROUPS_PER_STEP - 4 and reply.queued == 4


def test_grants_held_past_max_staleness_do_not_hold_back_the_others(two_tokens):
    """A sampler that takes grants and never sends the groups (nor lets its lease run out) holds places only while
    those groups could still be trained; once the trainer is past them, the others are admitted again."""
    stack, hostile, honest = two_tokens
    stack.buffer.log_step("epoch", 5, [])
    assert hostile.Admit(rollout_pb2.AdmitRequest(sampler_id="sampler-1", groups=8, policy_version=5)).granted == 8
    assert honest.admit(4, version=5, in_flight=0) == 0  # every place is the hostile sampler's
    stack.buffer.log_step("epoch", 7, [])  # the trainer went on (it had other groups): version 5 is now too stale
    hostile.Admit(rollout_pb2.AdmitRequest(sampler_id="sampler-1", groups=0, policy_version=7, in_flight=8))
    assert honest.admit(4, version=7, in_flight=0) == 4
