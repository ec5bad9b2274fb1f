"""The sampler's side of admission control: ask the ingest how many groups it may start.

The ingest (trainer_service/ingest/admission.py) admits a group only if the trainer can still train it within
trainer.max_staleness, counting the buffer and every sampler's groups in flight. A sampler refused waits the
reply's retry hint, then checks for newer weights and asks again, so it pauses instead of generating groups that
would be dropped as stale. An ingest that cannot answer now is asked again; one that refuses the request in a way no
retry changes (a token or sampler id refused) stops the sampler with a PermanentError.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from grpo_stream.common.runtime.console import detail_logger
from grpo_stream.common.rpc.grpc_util import MAX_CLAIM
from grpo_stream.common.runtime.errors import PermanentError, is_transient
from grpo_stream.protos import rollout_pb2
from grpo_stream.sampler_service.connect import refusal_fix

log = logging.getLogger(__name__)
detail = detail_logger(__name__)
OUTAGE_RETRY_S = 1.0


class AdmissionClient:
    def __init__(self, stub, sampler_id: str, enabled: bool, stop_event: threading.Event, process: str = ""):
        """`stub`: the ingest's RolloutIngestStub; `enabled`: sampler.admission; `process`: the random id this
        sampler process made at its start (the ingest refuses a process another one with its sampler id replaced)."""
        self.stub, self.sampler_id, self.stop_event, self.process = stub, sampler_id, stop_event, process
        self.enabled = enabled  # turned off for an ingest that predates Admit
        self.waited_s = 0.0
        self.refusals = 0
        self._warned = False
        self._version = 0  # the weight version of the last request (release() repeats it)

    def admit(self, wanted: int, version: int, in_flight: int) -> int:
        """How many of `wanted` groups of weight `version` may start now, `in_flight` being this sampler's groups
        the ingest has not answered yet. 0 after waiting out a refusal (the caller checks its weights and asks
        again). While the ingest cannot answer nothing is admitted; an ingest without Admit admits everything."""
        if not self.enabled:
            return wanted
        self._version = version
        # the ingest refuses more (an answer no retry changes: the sampler stopped for good with decode_slots /
        # num_generations over it, both valid settings); the rest at the next look
        wanted = min(wanted, MAX_CLAIM)
        started, retry_s = time.monotonic(), OUTAGE_RETRY_S
        try:
            reply = self.stub.Admit(rollout_pb2.AdmitRequest(sampler_id=self.sampler_id, groups=wanted,
                                                             policy_version=version, in_flight=in_flight,
                                                             process=self.process), timeout=5)
            self._warned = False
            if reply.granted > 0:  # (an int32: one below 0 from a faulty ingest is a refusal, not a negative count)
                return min(wanted, reply.granted)
            retry_s = max(reply.retry_after_ms, 10) / 1000
            detail.info("%s: no group admitted (version %d, trainer at step %d, %d groups queued); waiting",
                        self.sampler_id, version, reply.trainer_step, reply.queued)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("%s: the ingest does not implement Admit (an older version); generating without "
                            "admission control", self.sampler_id)
                self.enabled = False
                return wanted
            if not is_transient(exc):
                raise PermanentError(f"{self.sampler_id}: the ingest refuses admission requests ({exc.code().name}: "
                                     f"{exc.details()}); {refusal_fix(exc)}") from None
            if not self._warned:
                log.warning("%s: admission request failed (%s); generation pauses until the ingest answers",
                            self.sampler_id, exc.code().name)
                self._warned = True
        self.refusals += 1
        self.stop_event.wait(retry_s)
        self.waited_s += time.monotonic() - started
        return 0

    def release(self, timeout_s: float = 2.0) -> bool:
        """Tell the ingest this process holds no group any more (the sampler stops, after its drain: what it had not
        sent is dropped). Without it the ingest counted the stopped sampler's grants as in flight for
        sampler.admission_lease_s (600 s), and where they filled the staleness bound (trainer.max_staleness 0: one
        step's worth) every other sampler was refused, the trainer waiting for groups nobody could start, until the
        lease ran out. Best effort, never raises: an ingest that cannot answer counts them until then. True when the
        ingest took it."""
        if not self.enabled:
            return False
        try:
            self.stub.Admit(rollout_pb2.AdmitRequest(sampler_id=self.sampler_id, groups=0,
                                                     policy_version=self._version, in_flight=0,
                                                     process=self.process), timeout=timeout_s)
            return True
        except grpc.RpcError as exc:  # (a replaced process is refused: its successor reported its own count)
            log.info("%s: could not release its admission grants (%s); the ingest counts them until "
                     "sampler.admission_lease_s passes", self.sampler_id, exc.code().name)
            return False
