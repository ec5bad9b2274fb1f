"""The rollout sender's failures (issue 42): a stream that fails in a way a later one may not (UNAVAILABLE, no ack
within the deadline) is reconnected and its groups sent again; a refusal no retry changes stops the sender with a
PermanentError; a sender thread that dies of anything else stops the sampler too, instead of leaving it to generate
into a backlog nobody sends until the final version."""

import queue
import threading
import time
import types
from concurrent import futures

import grpc
import pytest

from grpo_stream.common.episodes.result import EpisodeResult, GroupWork
from grpo_stream.common.episodes.stream import GroupRun
from grpo_stream.common.runtime.errors import PermanentError, is_transient
from grpo_stream.common.tasks.reward_workers import RewardWorker
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc
from grpo_stream.sampler_service.group_sink import GroupSink
from grpo_stream.sampler_service.lifecycle import SamplerMetrics
from grpo_stream.sampler_service.rollout_client import IngestRefused, RolloutClient, SenderStopped
from tests.support import wait_for
from tests.unit.sampler_service.test_weight_sync import RpcError


def ack_all(batch, call):
    return rollout_pb2.BatchAck(acks=[rollout_pb2.GroupAck(group_id=g.group_id) for g in batch.groups])


def never(batch, call):
    """An ingest that takes the batch and never answers (a frozen peer): only a cancel ends the wait."""
    call.cancelled.wait()
    raise RpcError(grpc.StatusCode.CANCELLED, "cancelled by the client")


def failing(error, after_s: float = 0.0):
    def answer(batch, call):
        call.cancelled.wait(after_s)
        raise error
    return answer


class Call:
    """One StreamBatches call: each reply is `answer(batch, call)` for the next batch the client sends."""

    def __init__(self, requests, answer):
        self.requests, self.answer, self.cancelled = requests, answer, threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        return self.answer(next(self.requests), self)

    def cancel(self):
        self.cancelled.set()


class Stub:
    """Answers call k with answers[k] (the last one for every later call)."""

    def __init__(self, *answers):
        self.answers, self.calls = answers, 0

    def StreamBatches(self, requests):
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        return Call(iter(requests), answer)


@pytest.fixture
def make_client():
    made = []
    channel = grpc.insecure_channel("127.0.0.1:1")  # never dialled: the stub is replaced

    def make(stub, **kw) -> RolloutClient:
        client = RolloutClient(channel, kw.pop("backlog_max_groups", 8), **kw)
        client._stub = stub
        made.append(client)
        return client.start()

    yield make
    for client in made:
        client.close()
    channel.close()


def group(i: int) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(group_id=f"g{i}", sampler_id="sampler-0", policy_version=0)


def test_an_unavailable_stream_is_reconnected_and_nothing_is_lost(make_client):
    stub = Stub(failing(RpcError(grpc.StatusCode.UNAVAILABLE, "ingest restarting")), ack_all)
    client = make_client(stub)
    assert client.put(group(0), timeout_s=1)
    assert client.drain(10) and client.stats["reconnects"] == 1 and client.stats["accepted"] == 1
    client.check()  # still sending: nothing to raise


def test_a_stream_the_ingest_ended_on_its_own_error_is_retried_logging_the_reason(make_client, caplog):
    """An ingest that fails on an error of its own answers UNKNOWN (retried: a restart may mend it); the warning said
    only 'StatusCode.UNKNOWN', never which error, however often it came."""
    stub = Stub(failing(RpcError(grpc.StatusCode.UNKNOWN, "Exception iterating responses: redis auth refused")),
                ack_all)
    client = make_client(stub)
    assert client.put(group(0), timeout_s=1)
    assert client.drain(10) and client.stats["reconnects"] == 1
    assert "StatusCode.UNKNOWN: Exception iterating responses: redis auth refused" in caplog.text


def test_a_stream_without_an_ack_within_the_deadline_is_given_up_and_sent_again(make_client, caplog):
    stub = Stub(never, ack_all)
    client = make_client(stub, ack_timeout_s=0.3)
    started = time.monotonic()
    assert client.put(group(0), timeout_s=1)
    assert client.drain(10), "the group was never acknowledged on a new stream"
    assert time.monotonic() - started >= 0.3 and stub.calls == 2 and client.stats["reconnects"] == 1
    assert client.stats["accepted"] == 1 and "no acknowledgement within 0.3s (ACK_TIMEOUT_S)" in caplog.text


@pytest.mark.parametrize("code, kind, message", [
    (grpc.StatusCode.PERMISSION_DENIED, IngestRefused, "PERMISSION_DENIED: groups.0..sampler_id.*check its token"),
    (grpc.StatusCode.UNAUTHENTICATED, IngestRefused, "UNAUTHENTICATED"),
    (grpc.StatusCode.UNIMPLEMENTED, PermanentError, "UNIMPLEMENTED .*no retry changes"),
])
def test_a_refusal_no_retry_changes_stops_the_sender_with_a_permanent_error(make_client, code, kind, message):
    details = "groups[0].sampler_id: not this token's" if code == grpc.StatusCode.PERMISSION_DENIED else "no"
    stub = Stub(failing(RpcError(code, details)), ack_all)
    client = make_client(stub)
    assert client.put(group(0), timeout_s=1)
    wait_for(lambda: client.error is not None, 10, "the sender to stop on the refusal")
    assert stub.calls == 1 and not is_transient(client.error)  # not retried
    with pytest.raises(kind, match=message):
        client.put(group(1), timeout_s=1)
    with pytest.raises(kind, match=message):
        client.check()
    assert isinstance(client.error, PermissionError) == (kind is IngestRefused)  # as before issue 42


def test_a_sender_thread_dying_of_anything_else_is_raised_and_ends_a_drain_at_once(make_client):
    client = make_client(Stub(failing(KeyError("acks"))))
    assert client.put(group(0), timeout_s=1)
    wait_for(lambda: client.error is not None, 10, "the sender thread to die")
    started = time.monotonic()
    assert not client.drain(30) and time.monotonic() - started < 5  # nobody will acknowledge: no 30 s wait
    with pytest.raises(SenderStopped, match="rollout sender thread stopped: KeyError: 'acks'") as err:
        client.put(group(1), timeout_s=1)
    assert isinstance(err.value.__cause__, KeyError)


class Letters:
    def decode(self, ids):
        return " ".join(map(str, ids))


def finished_group(index: int) -> GroupRun:
    """A group whose episodes all ended, as the rollout stream hands it to the sink."""
    work = GroupWork(types.SimpleNamespace(prompt_id=f"p{index}", answer="3"), [1, 2], 2,
                     RewardSet({"answer_correct": 1.0}), f"run/sampler-0/{index}", index, None)
    run = GroupRun(work, stream=None, version=0)
    for row in range(2):
        result = EpisodeResult(finished=True)
        result.add_turn([3, 4], [-0.1, -0.2], [0, 0], True)
        run.results[row] = result
    return run


def test_a_sender_that_dies_while_the_backlog_is_full_stops_the_sampler(make_client):
    """The group sink pushes into a full backlog while the sender waits for an ack; the sender then dies: the sink
    stops with the sender's error within seconds (instead of waiting for room for ever), and the sampler's feeder
    raises it at its next look."""
    client = make_client(Stub(failing(RuntimeError("bug in the sender"), after_s=0.5)), backlog_max_groups=1)
    assert client.put(group(0), timeout_s=1)
    wait_for(lambda: client.put(group(1), timeout_s=0.1), 10, "the sender to take group 0 (the backlog holds 1)")
    sink = GroupSink(client, SamplerMetrics("sampler-0"), Letters(), "sampler-0", 0.0, abandon=lambda: False,
                     rewards=RewardWorker(["answer_correct"], 10.0))
    started = time.monotonic()
    sink.put(finished_group(2))

    def stopped() -> bool:
        try:
            sink.check()
        except SenderStopped:
            return True
        return False
    wait_for(stopped, 10, "the sink to stop with the sender's error")
    assert time.monotonic() - started < 10
    with pytest.raises(SenderStopped, match="RuntimeError: bug in the sender"):
        client.check()  # what the feeder checks first at every look
    sink.rewards.close()


def test_episodes_an_environment_ended_with_an_error_are_sent_counted_and_each_kind_logged_once(make_client, caplog):
    """An environment step or a chat template that fails ends its episode at that turn: the group is still trained
    as it stands, but the error was said nowhere, so a template that cut every episode to one turn went unseen."""
    client = make_client(Stub(ack_all))
    sink = GroupSink(client, SamplerMetrics("sampler-0"), Letters(), "sampler-0", 0.0, abandon=lambda: False,
                     rewards=RewardWorker(["answer_correct"], 10.0))
    for index in range(3):
        run = finished_group(index)
        run.results[1].error = "ValueError: environment: the chat template renders earlier turns differently"
        sink.put(run)
    wait_for(lambda: sink.groups_sent == 3, 10, "the sink to send the three groups")
    sink.close()
    assert sink.episodes_errored == 3 and sink.groups_failed == 0
    logged = [r.getMessage() for r in caplog.records if "ended with an error" in r.getMessage()]
    assert len(logged) == 1 and "renders earlier turns differently" in logged[0]


class SenderFirst(queue.Queue):
    """A backlog whose put lets the sender take the group, and settle it, before put returns: the order a sender
    thread that wins the race makes. `seen`: what `unacked` read right after the sender settled it."""

    def __init__(self, client):
        super().__init__()
        self.client, self.seen = client, []

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        taken = self.client._take([])  # what the sender thread does with it (dropped here when too stale)
        if taken:
            self.client._settle(taken, [rollout_pb2.GroupAck(group_id=item.group.group_id) for item in taken])
        self.seen.append(self.client.unacked)


@pytest.mark.parametrize("stale", [False, True], ids=["acknowledged", "dropped as stale"])
def test_a_group_the_sender_settles_before_put_returns_never_makes_the_in_flight_count_negative(stale):
    """The feeder reports unacked + ... to Admit as this sampler's groups in flight; the ingest refuses a negative
    count for good (INVALID_ARGUMENT), which stopped the sampler. A group was counted only after it was queued, so a
    sender that took and settled it first made `unacked` read -1."""
    channel = grpc.insecure_channel("127.0.0.1:1")  # never dialled: the sender thread is not started
    client = RolloutClient(channel, 8)
    client.min_version = 10 if stale else 0
    client._backlog = backlog = SenderFirst(client)
    try:
        assert client.put(group(0), timeout_s=1)
        assert backlog.seen == [0] and client.unacked == 0
        assert client.stats["dropped_stale" if stale else "accepted"] == 1
    finally:
        channel.close()


def test_a_put_that_finds_the_backlog_full_is_not_counted():
    channel = grpc.insecure_channel("127.0.0.1:1")
    client = RolloutClient(channel, 1)  # no sender: the backlog stays full
    try:
        assert client.put(group(0), timeout_s=1) and not client.put(group(1), timeout_s=0.01)
        assert client.unacked == 1
    finally:
        channel.close()


def test_groups_of_another_trainer_epoch_are_not_sent(make_client):
    """A restarted trainer numbers its versions from its checkpoint: a group made with the old trainer's v50 would
    read as a version from its future. Once the sampler fetched the new epoch's weights, queued groups of the old
    epoch (and those in hand, sent again after the reconnect) are dropped and counted; the new epoch's are sent."""
    sent = []

    def record(batch, call):
        sent.extend(g.group_id for g in batch.groups)
        return ack_all(batch, call)
    client = make_client(Stub(record), backlog_max_groups=8)
    client.epoch = "new"
    assert client.put(group(0), timeout_s=1, epoch="old") and client.put(group(1), timeout_s=1, epoch="new")
    assert client.put(group(2), timeout_s=1)  # no epoch known (a transport without one): sent
    assert client.drain(10)
    assert sent == ["g1", "g2"] and client.stats["dropped_epoch"] == 1 and client.unacked == 0


def test_an_evaluation_only_answer_is_sent_whatever_its_weights_age_or_epoch(make_client):
    """An injected train=false prompt's answer is never trained: dropping it as stale or of another epoch left the
    prompt to wait out its claim lease and be generated again, up to prompts.max_claims times, then cancelled."""
    sent = []

    def record(batch, call):
        sent.extend(g.group_id for g in batch.groups)
        return ack_all(batch, call)
    client = make_client(Stub(record), backlog_max_groups=8)
    client.epoch, client.min_version = "new", 10  # group() is made with version 0
    assert client.put(group(0), timeout_s=1, epoch="old", evaluation_only=True)
    assert client.put(group(1), timeout_s=1, evaluation_only=True)
    assert client.put(group(2), timeout_s=1, epoch="old") and client.put(group(3), timeout_s=1)  # training groups
    assert client.drain(10)
    assert sent == ["g0", "g1"] and client.stats["dropped_epoch"] == 1 and client.stats["dropped_stale"] == 1


class AckingIngest(rollout_pb2_grpc.RolloutIngestServicer):
    """A real ingest servicer that acknowledges every group it receives."""

    def __init__(self):
        self.received = []

    def StreamBatches(self, batches, context):
        for batch in batches:
            self.received.extend(g.group_id for g in batch.groups)
            yield ack_all(batch, None)


@pytest.fixture
def small_message_ingest():
    """A real gRPC ingest and a channel to it whose messages may carry 256 KiB (what 64 MiB is to a real run)."""
    limit = 256 << 10
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]
    server = grpc.server(futures.ThreadPoolExecutor(2), options=options)
    ingest = AckingIngest()
    rollout_pb2_grpc.add_RolloutIngestServicer_to_server(ingest, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
    clients = []

    def make(**kw) -> RolloutClient:
        client = RolloutClient(channel, 16, 16, max_batch_bytes=limit - 1024, **kw)
        clients.append(client)
        return client.start()

    yield ingest, make
    for client in clients:
        client.close()
    channel.close()
    server.stop(0)


def long_group(i: int, kib: int) -> rollout_pb2.RolloutGroup:
    """A group whose completion's token ids take `kib` KiB (long completions)."""
    completion = rollout_pb2.Completion(token_ids_le=b"\x01" * (kib << 10), logprobs_le=b"")
    return rollout_pb2.RolloutGroup(group_id=f"g{i}", sampler_id="sampler-0", policy_version=0,
                                    completions=[completion])


def test_long_groups_are_sent_in_batches_the_channel_carries(small_message_ingest):
    """Batches were capped by count alone: 6 groups of 100 KiB made one message over the channel's limit, which gRPC
    fails as RESOURCE_EXHAUSTED (retried): the same batch went again for ever and nothing was acknowledged."""
    ingest, make = small_message_ingest
    client = make()
    for i in range(6):
        assert client.put(long_group(i, 100), timeout_s=1)
    assert client.drain(20), f"unacknowledged: {client.unacked}, stats {dict(client.stats)}"
    assert ingest.received == [f"g{i}" for i in range(6)] and client.stats["accepted"] == 6
    assert client.stats["reconnects"] == 0


def test_a_group_larger_than_a_message_is_dropped_with_the_settings_to_change(small_message_ingest, caplog):
    ingest, make = small_message_ingest
    client = make()
    assert client.put(long_group(0, 10), timeout_s=1) and client.put(long_group(1, 300), timeout_s=1)
    assert client.put(long_group(2, 10), timeout_s=1)
    assert client.drain(20), f"unacknowledged: {client.unacked}, stats {dict(client.stats)}"
    assert ingest.received == ["g0", "g2"] and client.stats["rejected_too_large"] == 1
    assert "group g1 not sent" in caplog.text and "generation.max_new_tokens" in caplog.text
