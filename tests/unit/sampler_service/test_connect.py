"""The sampler's start-up contacts and admission requests retry what a later call may not meet and raise at once
what every call would meet again (issue 42): a trainer or ingest not up yet is waited for; a refused token is not."""

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.protos import rollout_pb2
from grpo_stream.sampler_service.admission_client import AdmissionClient
from grpo_stream.sampler_service.connect import Resume, resume_position, wait_for_trainer
from tests.unit.sampler_service.test_weight_sync import RpcError

SERVING = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class Stub:
    """Each call of any method raises the next of `errors`, then returns `reply`."""

    def __init__(self, errors, reply):
        self.errors, self.reply, self.calls = list(errors), reply, 0

    def _call(self, request, timeout=None):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.reply

    Check = GetDataPosition = Admit = _call


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, ["sampler.connect_timeout_s=30"])


def test_a_trainer_starting_up_is_waited_for(cfg):
    stub = Stub([RpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"),
                 RpcError(grpc.StatusCode.NOT_FOUND, "unknown service")], SERVING)  # (server up, not yet marked)
    wait_for_trainer(cfg, stub, threading.Event())
    assert stub.calls == 3


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED])
def test_a_health_check_refused_for_good_is_raised_at_once(cfg, code):
    stub = Stub([RpcError(code, "missing token")] * 5, SERVING)
    with pytest.raises(PermanentError, match=f"health check answered {code.name}"):
        wait_for_trainer(cfg, stub, threading.Event())
    assert stub.calls == 1


def test_the_data_position_is_asked_again_while_the_ingest_cannot_answer(cfg):
    stub = Stub([RpcError(grpc.StatusCode.UNAVAILABLE, "rollout buffer unavailable"),
                 RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "rpc.calls_per_caller")],
                rollout_pb2.DataPosition(known=True, position=41))
    assert resume_position(cfg, "sampler-0", stub, threading.Event()) == Resume(42) and stub.calls == 3


def test_unanswered_positions_below_the_start_are_kept_sorted_once_and_checked():
    """The ingest's unanswered positions come back sorted and unique; any not below the start (a damaged or foreign
    answer) is left out rather than generated twice."""
    stub = Stub([], rollout_pb2.DataPosition(known=True, position=41, unanswered=[39, 12, 39, 41, 60, -3, 40]))
    assert resume_position(None, "sampler-0", stub, threading.Event()) == Resume(42, (12, 39, 40, 41))
    assert resume_position(None, "sampler-0", Stub([], rollout_pb2.DataPosition()), threading.Event()) == Resume()


def test_a_data_position_request_refused_for_good_is_raised_at_once(cfg):
    stub = Stub([RpcError(grpc.StatusCode.PERMISSION_DENIED, "sampler_id: not this token's")] * 5,
                rollout_pb2.DataPosition())
    with pytest.raises(PermanentError, match="PERMISSION_DENIED: sampler_id: not this token's"):
        resume_position(cfg, "sampler-0", stub, threading.Event())
    assert stub.calls == 1


def test_admission_waits_out_an_outage_and_raises_a_refusal():
    stop = threading.Event()
    stop.set()  # (the outage wait returns at once)
    stub = Stub([RpcError(grpc.StatusCode.UNAVAILABLE, "down")], rollout_pb2.AdmitReply(granted=3))
    admission = AdmissionClient(stub, "sampler-0", True, stop)
    assert admission.admit(4, 0, 0) == 0 and admission.admit(4, 0, 0) == 3  # nothing while down, then granted
    refused = AdmissionClient(Stub([RpcError(grpc.StatusCode.UNAUTHENTICATED, "bad token")], None), "sampler-0",
                              True, stop)
    with pytest.raises(PermanentError, match="refuses admission requests .UNAUTHENTICATED: bad token"):
        refused.admit(4, 0, 0)


def test_a_damaged_buffer_refusal_is_not_blamed_on_the_sampler_token(cfg):
    """The ingest answers FAILED_PRECONDITION naming a damaged buffer record: the sampler's error passes that on
    without telling the operator to check the sampler's token (the wrong way)."""
    damaged = "rollout buffer damaged: grpo:positions field sampler-0 holds 'x', not an integer"
    stub = Stub([RpcError(grpc.StatusCode.FAILED_PRECONDITION, damaged)], rollout_pb2.DataPosition())
    with pytest.raises(PermanentError, match="mend what the ingest's message names") as raised:
        resume_position(cfg, "sampler-0", stub, threading.Event())
    assert damaged in str(raised.value) and "token" not in str(raised.value)
    refused = AdmissionClient(Stub([RpcError(grpc.StatusCode.FAILED_PRECONDITION, damaged)], None), "sampler-0",
                              True, threading.Event())
    with pytest.raises(PermanentError, match="mend what the ingest's message names") as raised:
        refused.admit(4, 0, 0)
    assert "token" not in str(raised.value)


def test_a_grant_below_zero_starts_no_group():
    """AdmitReply.granted is an int32 the ingest fills (0..groups): a negative one (an ingest of another version, a
    bug) is a refusal, never a negative count of groups for the feeder to start."""
    stop = threading.Event()
    stop.set()  # (the refusal's wait returns at once)
    admission = AdmissionClient(Stub([], rollout_pb2.AdmitReply(granted=-5, retry_after_ms=100)), "sampler-0",
                                True, stop)
    assert admission.admit(4, 0, 0) == 0 and admission.refusals == 1
