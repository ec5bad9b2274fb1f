"""The ingest: a gRPC service that validates rollout groups and appends them to the buffer.

Flow control: when the buffer holds `buffer.max_groups` groups the ingest
answers RESOURCE_EXHAUSTED with a retry hint and the producer keeps the
group and sends it again later, so nothing is dropped. A bad group is
refused with INVALID_ARGUMENT naming the field; the service stays up.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading

import grpc
import numpy as np
import redis
from google.protobuf.message import DecodeError

from grpo_stream.common.rollouts.buffer import BufferUnavailable, Incoming, RedisStreamBuffer
from grpo_stream.common.rollouts.redis_errors import DamagedRecord
from grpo_stream.common.rpc.auth import MAX_REPLICA, TokenTable, caller_of, may_act_as
from grpo_stream.common.rpc.grpc_util import MAX_CLAIM
from grpo_stream.trainer_service.ingest.admission import RETRY_AFTER_MS, AdmissionControl, SharedSamplerId
from grpo_stream.trainer_service.ingest.claim_check import checked_claim
from grpo_stream.trainer_service.ingest.group_bounds import (VersionCeiling, newest_version, text_errors,
                                                             version_errors)
from grpo_stream.trainer_service.ingest.prompt_queue import NOT_A_HASH, InjectedShare, PromptQueue
from grpo_stream.common.tasks.rewards import allowed_names
from grpo_stream.common.rollouts.wire import GroupLimits, validate_group
from grpo_stream.protos import rollout_pb2, rollout_pb2_grpc

log = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_STAT = {0: "accepted", _INVALID: "invalid", _EXHAUSTED: "full", _UNAVAILABLE: "unavailable"}
_ANSWERED = {"eval": "evaluation only: recorded as the prompt's result, never trained",
             "cancelled": "the prompt was cancelled: answer discarded", "dup": "duplicate: accepted before"}
MAX_BATCH_GROUPS = 1024  # groups in one StreamBatches message (a sampler sends 16)
# how far below a sampler's highest accepted position GetDataPosition looks for unanswered ones: what a sampler holds
# in flight and in its backlog when it stops is far less; a gap further down is a prompt skipped for good
UNANSWERED_WINDOW = 4096
MAX_TEXT_CHARS = 32_768  # prompts.max_text_chars' default


@dataclasses.dataclass(frozen=True)
class Injection:
    """What the ingest needs to take injected prompts' answers and hand out prompts (None: no injection here)."""

    queue: PromptQueue
    run_name: str
    claim_lease_s: float = 300.0
    retention_s: int = 7 * 86_400
    max_kept: int = 10_000
    # reward names an injected prompt may ask for (built-ins and task.rewards); other prompts are refused at the claim
    rewards: frozenset[str] = frozenset(allowed_names(()))
    share: InjectedShare | None = None  # the injected share of each sampler's rows (None: no limit)
    max_claims: int = 3  # leases a prompt may run out before it is given up (prompts.max_claims)


class IngestServicer(rollout_pb2_grpc.RolloutIngestServicer):
    def __init__(self, buffer: RedisStreamBuffer, limits: GroupLimits, max_groups: int, retry_after_ms: int,
                 injection: Injection | None = None, admission: AdmissionControl | None = None,
                 table: TokenTable | None = None, max_text_chars: int = MAX_TEXT_CHARS):
        """`admission`: the samplers' admission control (None: every Admit request is granted in full); `table`:
        the servers' token table, which binds each sampler token to its sampler ids (None: no auth);
        `max_text_chars`: prompts.max_text_chars, the most characters of a group's reference_answer."""
        self.buffer, self.limits, self.table, self.max_text_chars = buffer, limits, table, max_text_chars
        self.versions = VersionCeiling(buffer)
        self.max_groups, self.retry_after_ms = max_groups, retry_after_ms
        self.injection, self.admission = injection, admission
        self._lock = threading.Lock()
        self.stats = {"accepted": 0, "duplicate": 0, "invalid": 0, "full": 0, "unavailable": 0, "claimed": 0}

    def _check_injected(self, groups) -> dict[int, list[str]]:
        """Errors of injected prompts' answers by position, checked against the queued prompt: the group id the
        prompt owns, its token ids and its num_generations (which may differ from the run's for train=false)."""
        positions = [i for i, g in enumerate(groups) if g.injected]
        if not positions:
            return {}
        if self.injection is None:
            return {i: ["injected: this ingest takes no injected prompts"] for i in positions}
        inj = self.injection
        records = inj.queue.records([groups[i].prompt_id for i in positions])
        out = {}
        for i, record in zip(positions, records):
            g = groups[i]
            if record is NOT_A_HASH:  # someone else wrote Redis: this answer only is refused
                out[i] = [f"prompt_id: the Redis key of injected prompt {g.prompt_id[:64]!r} is not a hash (something "
                          "other than grpo-stream wrote it); delete the key and submit the prompt again"]
                continue
            if record is None:
                out[i] = [f"prompt_id: no injected prompt {g.prompt_id[:64]!r} (never submitted, or expired)"]
                continue
            try:
                prompt = rollout_pb2.InjectedPrompt.FromString(record[b"req"])
            except (KeyError, DecodeError):  # someone else wrote Redis: this answer only is refused
                out[i] = [f"prompt_id: the queued record of {g.prompt_id[:64]!r} in Redis is damaged (its 'req' is "
                          "not an InjectedPrompt); cancel the prompt and submit it again"]
                continue
            errors = validate_group(g, dataclasses.replace(self.limits, num_generations=prompt.num_generations))
            if g.group_id != f"{inj.run_name}/inj/{g.prompt_id}":
                errors.append(f"group_id: an injected prompt's group id is '{inj.run_name}/inj/<prompt_id>'")
            if not np.array_equal(np.asarray(g.prompt_token_ids), np.asarray(prompt.prompt_token_ids)):
                errors.append("prompt_token_ids: differ from the injected prompt's")
            out[i] = errors
        return out

    def _checked(self, groups, injected: dict) -> list[list[str] | None]:
        """Each group's errors (None: Redis is down, answer UNAVAILABLE): its shape (an injected prompt's answer
        against its prompt: `injected`), its free text's size, and its versions against the newest published."""
        out = []
        for position, group in enumerate(groups):
            errors = injected[position] if position in injected else validate_group(group, self.limits)
            out.append(text_errors(group, self.max_text_chars) if errors == [] else errors)
        # the versions of the groups still valid ([]): None (Redis down) and a refusal stay as they are
        newest = max((newest_version(g) for g, e in zip(groups, out) if e == []), default=-1)
        if newest < 0:
            return out
        try:
            ceiling = self.versions.at_least(newest)
        except BufferUnavailable as exc:
            log.error("buffer unavailable: %s", exc)
            return [None if e == [] else e for e in out]
        return [version_errors(g, ceiling) if e == [] else e for g, e in zip(groups, out)]

    def handle_batch(self, groups) -> list[rollout_pb2.GroupAck]:
        """Validate every group, append the valid ones in one buffer call; one ack per group, in order.

        A group id the buffer accepted before is acknowledged OK again ("duplicate") without a second copy: its
        sender lost the first acknowledgement (a dropped stream, an ingest restart) and must not keep it."""
        acks: list[rollout_pb2.GroupAck | None] = []
        valid: list[tuple[int, rollout_pb2.RolloutGroup]] = []
        rejected: list[tuple[rollout_pb2.RolloutGroup, str]] = []
        for group in groups:  # protobuf writes back fields it did not know: unchecked bytes, into Redis
            group.DiscardUnknownFields()
        try:
            injected = self._check_injected(groups)
        except BufferUnavailable as exc:
            injected = {i: None for i, g in enumerate(groups) if g.injected}
            log.error("buffer unavailable: %s", exc)
        checked = self._checked(groups, injected)
        for group, errors in zip(groups, checked):
            if errors is None:  # Redis down: retry later
                acks.append(rollout_pb2.GroupAck(group_id=group.group_id, code=_UNAVAILABLE, retry_after_ms=1000,
                                                 message="rollout buffer unavailable; retry with backoff"))
                continue
            if errors:
                message = "; ".join(errors)
                rejected.append((group, message))
                acks.append(rollout_pb2.GroupAck(group_id=group.group_id, code=_INVALID, message=message))
            else:
                valid.append((len(acks), group))
                acks.append(None)
        if rejected:  # one line a batch, ids and message cut: a hostile sender must not be able to flood the log
            first, message = rejected[0]
            log.warning("rejected %d of %d groups from %r; the first, %r: %s", len(rejected), len(groups),
                        first.sampler_id[:64], first.group_id[:64], message[:500])
        statuses, depth = [], 0
        try:
            statuses, depth = self.buffer.append_many(
                [Incoming(g.group_id, g.sampler_id, g.policy_version, g.data_position if g.HasField("data_position")
                          else -1, g.SerializeToString(), g.prompt_id if g.injected else "") for _, g in valid],
                self.max_groups, refused_invalid=sum(a is not None and a.code == _INVALID for a in acks),
                **({} if self.injection is None else {"retention_s": self.injection.retention_s,
                                                      "max_kept": self.injection.max_kept}))
        except BufferUnavailable as exc:
            log.error("buffer unavailable: %s", exc)
            for slot, g in valid:
                acks[slot] = rollout_pb2.GroupAck(
                    group_id=g.group_id, code=_UNAVAILABLE, retry_after_ms=1000,
                    message=f"rollout buffer unavailable ({exc}); retry with backoff")
        duplicates = set()  # slots of groups accepted before: answered then, not in flight now
        for (slot, g), status in zip(valid, statuses):
            if status == "full":
                acks[slot] = rollout_pb2.GroupAck(
                    group_id=g.group_id, code=_EXHAUSTED, retry_after_ms=self.retry_after_ms,
                    buffer_depth=depth, message=f"{depth} groups wait for the trainer (buffer.max_groups="
                                                f"{self.max_groups}); retry after {self.retry_after_ms} ms")
            elif status == "unknown":  # the prompt expired between the check and the append
                acks[slot] = rollout_pb2.GroupAck(group_id=g.group_id, code=_INVALID, buffer_depth=depth,
                                                  message=f"prompt_id: no injected prompt {g.prompt_id[:64]!r}")
            else:
                if status == "dup":
                    duplicates.add(slot)
                acks[slot] = rollout_pb2.GroupAck(group_id=g.group_id, code=0, buffer_depth=depth,
                                                  message=_ANSWERED.get(status, ""))
        with self._lock:
            for ack in acks:
                self.stats[_STAT[ack.code]] += 1
            self.stats["accepted"] -= len(duplicates)
            self.stats["duplicate"] += len(duplicates)
        if self.admission is not None:  # answered for good: no longer in flight at its sampler
            done = collections.defaultdict(list)
            for slot, (g, ack) in enumerate(zip(groups, acks)):
                # a resent copy (its first acknowledgement lost) was counted answered when the first arrived:
                # counting it again took another in-flight group off the sampler's count, for good (a report only
                # lowers it), and the ingest granted past the staleness bound
                # (and a copy of a refused one, or of one accepted by this ingest, is told by its id: answered())
                if ack.code in (0, _INVALID) and slot not in duplicates:
                    done[g.sampler_id].append((g.policy_version, g.group_id))
            for sampler_id, answered in done.items():
                self.admission.answered(sampler_id, [v for v, _ in answered], [g for _, g in answered])
        return acks

    def _check_identity(self, context, groups) -> None:
        """Abort with PERMISSION_DENIED unless the caller may speak for every group's sampler id, and each dataset
        group's id is the one that sampler makes for its data position ('<run>/<sampler id>/<position>'): a group
        id is the buffer's de-duplication key, so a sampler that could send another's ids would have the real
        sampler's groups refused as duplicates."""
        caller = caller_of(context, self.table)
        if caller.role == "admin":
            self._check_run_name(context, groups)
            return
        for k, g in enumerate(groups):
            if not g.sampler_id:
                continue  # refused by validation, naming the field
            if not may_act_as(caller, g.sampler_id):
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"groups[{k}].sampler_id: {g.sampler_id[:64]!r} is "
                              f"not this token's ({caller.name!r} may send as {caller.name!r} or "
                              f"'{caller.name}-<k>'); give each sampler its own token or fix sampler ids")
            if g.injected:
                continue  # an injected answer's id is checked against its prompt (_check_injected)
            # the whole id, not its tail: 'x/<sampler>/<p>' beside '<run>/<sampler>/<p>' were two group ids for one
            # data position, both appended (the de-duplication key is the id) and trained twice
            own = f"{self.buffer.run_name}/{g.sampler_id}/{g.data_position}"
            if g.HasField("data_position") and g.group_id != own:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"groups[{k}].group_id: {g.group_id[:64]!r} is not "
                              f"sampler {g.sampler_id[:64]!r}'s id for data position {g.data_position} "
                              f"({own[:200]!r}: '<run>/<sampler id>/<position>'; does the sampler's run.name differ "
                              "from the ingest's?)")

    def _check_run_name(self, context, groups) -> None:
        """Abort with INVALID_ARGUMENT when a dataset group's id is its sampler's id for its data position under
        another run name ('<other>/<sampler id>/<position>'). Without auth, or under an admin token, ids are not bound
        to the caller, but that one is a sampler whose run.name differs from the ingest's: its groups were accepted,
        yet GetDataPosition looks for '<run>/<sampler id>/<position>' and reported each of them unanswered, so a
        restarted sampler generated them all again, every one answered as a duplicate."""
        for k, g in enumerate(groups):
            if g.injected or not g.sampler_id or not g.HasField("data_position"):
                continue
            tail = f"/{g.sampler_id}/{g.data_position}"
            own = self.buffer.run_name + tail
            if g.group_id.endswith(tail) and g.group_id != own:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"groups[{k}].group_id: {g.group_id[:64]!r} names run "
                              f"{g.group_id[:-len(tail)][:64]!r}, but this ingest serves run "
                              f"{self.buffer.run_name!r} ({own[:200]!r}: '<run>/<sampler id>/<position>'); set the "
                              "sampler's run.name to the trainer's")

    def _check_sampler(self, context, sampler_id: str) -> None:
        caller = caller_of(context, self.table)
        if not may_act_as(caller, sampler_id):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"sampler_id: {sampler_id[:64]!r} is not this token's "
                          f"({caller.name!r} may act as {caller.name!r} or '{caller.name}-<k>', k in 0..{MAX_REPLICA})")

    def StreamBatches(self, request_iterator, context):
        for batch in request_iterator:
            if len(batch.groups) > MAX_BATCH_GROUPS:  # before any work: each group costs validation and an ack
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"groups: {len(batch.groups)} groups in one batch, "
                              f"at most {MAX_BATCH_GROUPS}; send them in smaller batches")
            self._check_identity(context, batch.groups)
            with buffer_errors(context):
                acks = self.handle_batch(batch.groups)
            yield rollout_pb2.BatchAck(acks=acks)

    def PushGroup(self, request, context):
        self._check_identity(context, [request])
        with buffer_errors(context):
            ack = self.handle_batch([request])[0]
        if ack.code:
            code = next(c for c in grpc.StatusCode if c.value[0] == ack.code)
            if ack.retry_after_ms:
                context.set_trailing_metadata((("retry-after-ms", str(ack.retry_after_ms)),))
            context.abort(code, ack.message)
        return ack

    def GetDataPosition(self, request, context):
        if not request.sampler_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "sampler_id: must not be empty")
        self._check_sampler(context, request.sampler_id)
        with buffer_errors(context):
            position = self.buffer.data_position(request.sampler_id)
            unanswered = [] if position is None else self.buffer.unanswered_positions(
                request.sampler_id, position, UNANSWERED_WINDOW)
        return rollout_pb2.DataPosition(known=position is not None, position=position or 0, unanswered=unanswered)

    def _check_request_count(self, context, sampler_id: str, field: str, count: int) -> None:
        """Abort with INVALID_ARGUMENT unless the sampler id is 1..max_id_length characters and `field` (a count
        of prompts or groups) is within 0..MAX_CLAIM."""
        if not sampler_id or len(sampler_id) > self.limits.max_id_length:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"sampler_id: must be 1..{self.limits.max_id_length} characters")
        if not 0 <= count <= MAX_CLAIM:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {count} outside 0..{MAX_CLAIM}")
        self._check_sampler(context, sampler_id)

    def ClaimPrompts(self, request, context):
        self._check_request_count(context, request.sampler_id, "max_prompts", request.max_prompts)
        if self.injection is None:
            return rollout_pb2.ClaimedPrompts()
        try:
            inj = self.injection
            # the batch this claim fills is the one the sampler was just admitted for (a replica that did not
            # admit it assumes a full batch)
            batch = None if self.admission is None else self.admission.take_granted(request.sampler_id)
            raw = inj.queue.claim(request.sampler_id, request.max_prompts, inj.claim_lease_s, inj.share, batch,
                                  given_up=(inj.max_claims, inj.retention_s, inj.max_kept))
            prompts = checked_claim(inj.queue, raw, inj.rewards, inj.retention_s, inj.max_kept)
        except BufferUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prompt queue unavailable ({exc}); retry with backoff")
        with self._lock:
            self.stats["claimed"] += len(raw)
        return rollout_pb2.ClaimedPrompts(prompts=prompts)

    def Admit(self, request, context):
        self._check_request_count(context, request.sampler_id, "groups", request.groups)
        if request.in_flight < 0 or request.policy_version < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "in_flight and policy_version: must not be negative")
        if self.admission is None:
            return rollout_pb2.AdmitReply(granted=request.groups)
        with buffer_errors(context):
            state = self.buffer.admission_state()
        try:
            granted, queued = self.admission.admit(state, request.sampler_id, request.groups,
                                                   request.policy_version, request.in_flight, request.process[:64])
        except SharedSamplerId as exc:  # the replaced process must stop: asking again will not mend it
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return rollout_pb2.AdmitReply(granted=granted, retry_after_ms=0 if granted else RETRY_AFTER_MS,
                                      trainer_step=state.trainer_step, queued=queued)


@contextlib.contextmanager
def buffer_errors(context):
    """A buffer call's failure as the call's status: UNAVAILABLE while Redis is away (retry with backoff),
    FAILED_PRECONDITION for a damaged record (an operator must mend it: waiting would not). The append script refuses
    damaged keys with a DAMAGEDBUFFER error naming the key and the fix, and a read of a key of another type fails
    WRONGTYPE: both escaped as UNKNOWN, which a sampler retries as passing, for ever, logging no reason."""
    try:
        yield
    except BufferUnavailable as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, f"rollout buffer unavailable ({exc}); retry with backoff")
    except DamagedRecord as exc:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"rollout buffer damaged: {exc}")
    except redis.ResponseError as exc:
        text = str(exc)
        if not text.startswith("DAMAGEDBUFFER ") and "WRONGTYPE" not in text:
            raise
        log.error("rollout buffer damaged: %s", text[:500])
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"rollout buffer damaged: {text.removeprefix('DAMAGEDBUFFER ')}")
