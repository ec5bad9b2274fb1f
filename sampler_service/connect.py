"""A sampler's start-up contacts: the trainer's health check, and where in its data stream it resumes.

Both wait with back-off for what a later call may not meet (a trainer or ingest not up yet, restarting, its Redis
away) and raise a PermanentError at once for what every call would meet again (a token refused, a server that is
not a grpo-stream trainer)."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.runtime.backoff import Backoff
from grpo_stream.common.runtime.errors import PermanentError, is_transient
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)


def trainer_serving(stub: health_pb2_grpc.HealthStub, address: str = "") -> bool:
    """The trainer answers its health check as SERVING. grpc.RpcError when it does not answer now (down, starting:
    NOT_FOUND until its server has marked the service); PermanentError when it answers what a retry would answer
    again (a token refused, no health service: not a grpo-stream trainer)."""
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service="grpo_stream.v1.WeightService"), timeout=5)
    except grpc.RpcError as exc:
        if is_transient(exc) or exc.code() == grpc.StatusCode.NOT_FOUND:
            raise
        raise PermanentError(f"sampler.trainer_address={address}: the trainer's health check answered "
                             f"{exc.code().name} ({exc.details()}); check the sampler's token (auth.token_file, "
                             "$GRPO_STREAM_TOKEN_FILE) and that the address is a grpo-stream trainer") from None
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_for_trainer(cfg: RunConfig, stub: health_pb2_grpc.HealthStub, stop_event: threading.Event) -> None:
    """Until the trainer answers its health check; ConnectionError after sampler.connect_timeout_s of silence."""
    deadline = time.monotonic() + cfg.sampler.connect_timeout_s
    backoff = Backoff(0.2, 2.0)
    while not stop_event.is_set():
        try:
            if trainer_serving(stub, cfg.trainer_address()):
                return
        except grpc.RpcError as exc:
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"sampler.trainer_address={cfg.trainer_address()}: trainer not reachable after "
                    f"{cfg.sampler.connect_timeout_s:.0f}s ({exc.code()}); start the trainer or fix the "
                    "address") from None
        if backoff.attempts == 0 or backoff.at_cap:
            log.info("waiting for the trainer at %s", cfg.trainer_address())
        stop_event.wait(backoff.next())  # a stop ends the wait at once


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where a sampler's data stream resumes: `start`, the position after its last accepted group (0 for a new run),
    and `unanswered`, the positions below it with no accepted group (ascending), which it generates first: groups
    end out of order, so those in flight or unsent when it stopped lie below positions accepted after them."""

    start: int = 0
    unanswered: tuple[int, ...] = ()


def refusal_fix(exc: grpc.RpcError) -> str:
    """What to mend when the ingest refuses a call for good: the sampler's credentials for an authentication
    refusal; otherwise the ingest's own message names it (a damaged buffer record: its key and the command that
    restores it), and a hint about tokens would send the operator the wrong way."""
    if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return "check the sampler's token (auth.token_file, $GRPO_STREAM_TOKEN_FILE) and sampler id"
    return "mend what the ingest's message names, then restart the sampler"


def resume_position(cfg: RunConfig, sampler_id: str, stub: rollout_pb2_grpc.RolloutIngestStub,
                    stop_event: threading.Event) -> Resume:
    """Where this sampler resumes (Resume), asked of the ingest. Waits with back-off while the ingest's Redis is
    down (as long as the ingest answers), or while the ingest itself is unreachable, for up to
    sampler.connect_timeout_s of silence."""
    heard, backoff = time.monotonic(), Backoff(0.2, 5.0)
    while True:
        try:
            reply = stub.GetDataPosition(rollout_pb2.DataPositionRequest(sampler_id=sampler_id), timeout=10)
            if not reply.known:
                return Resume()
            # an ingest's answer is checked, not trusted: only positions below the start, each once
            return Resume(reply.position + 1, tuple(sorted({p for p in reply.unanswered if 0 <= p <= reply.position})))
        except grpc.RpcError as exc:
            if stop_event.is_set():  # stopping before the first batch: the position no longer matters
                return Resume()
            if not is_transient(exc):
                raise PermanentError(
                    f"ingest at {cfg.ingest_address()} (ingest.address): it refuses this sampler's data position "
                    f"request ({exc.code().name}: {exc.details()}); {refusal_fix(exc)}") from None
            if "buffer unavailable" in (exc.details() or ""):
                heard = time.monotonic()  # the ingest answers; its Redis is away
            if time.monotonic() - heard > cfg.sampler.connect_timeout_s:
                raise ConnectionError(
                    f"ingest at {cfg.ingest_address()} (ingest.address): cannot get this sampler's data "
                    f"position ({exc.code()}: {exc.details()}); start the ingest / its Redis or fix the address"
                ) from None
            delay = backoff.next()
            log.warning("%s: ingest at %s not ready (%s: %s); retrying in %.1fs", sampler_id,
                        cfg.ingest_address(), exc.code().name, exc.details(), delay)
            if stop_event.wait(delay):  # stopping before the first batch: the position no longer matters
                return Resume()
