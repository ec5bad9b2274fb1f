"""PromptService: clients inject prompts into a live run, follow their scored results, cancel them, read the status.

Served next to the ingest (which holds the Redis connection and the tokenizer). Every request is checked against
the `prompts` limits before anything is queued; a refusal names the field and the limit. The queue itself, and
the recording of answers, live in Redis (prompt_queue.py), so any number of ingest replicas serve one run.
"""

from __future__ import annotations

import json
import logging
import re

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from grpo_stream.common.rpc.auth import TokenTable, caller_of
from grpo_stream.common.rollouts.buffer import BufferUnavailable
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.trainer_service.ingest.prompt_queue import NOT_A_HASH, ForeignKey, PromptQueue, QueueFull
from grpo_stream.trainer_service.ingest.run_status import StatusWriter, fill_status
from grpo_stream.common.tasks.rewards import TASK_REWARDS, allowed_names, numeric_reference_problem, unknown_reward
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc, rollout_pb2

log = logging.getLogger(__name__)
__all__ = ["PromptServicer", "StatusWriter", "record_tags"]  # StatusWriter: the trainer's loop imports it here
TAG = re.compile(r"[\w.:/@+-]+")  # whole tags only (fullmatch): "$" would pass a trailing newline
MAX_IDS = 10_000
MAX_REWARDS = 16
FOLLOW_POLL_MS = 1000
RECORDS_AT_ONCE = 64  # whole prompt records (each with its answer group) a follower reads at a time


class PromptServicer(prompts_pb2_grpc.PromptServiceServicer):
    def __init__(self, cfg: RunConfig, queue: PromptQueue, tokenizer, task, table: TokenTable | None):
        self.cfg, self.queue, self.tokenizer, self.task, self.table = cfg, queue, tokenizer, task, table
        self.limits = cfg.prompts
        # rewards a client may name: built-ins and the run's own; never an import path from the network
        self.rewards = allowed_names(cfg.task.rewards, cfg.task.name)

    # -- Submit -----------------------------------------------------------------------------------------------------
    def _render(self, spec: prompts_pb2.PromptSpec) -> str:
        return spec.text if spec.WhichOneof("input") == "text" else self.task.render_question(spec.question)

    def _check(self, i: int, spec: prompts_pb2.PromptSpec, ceiling: int | None = None) -> tuple[str | None, list[int]]:
        """(error naming the field and limit, prompt token ids); `ceiling`: the caller token's max_priority."""
        lim, at, n_run = self.limits, f"prompts[{i}]", self.cfg.generation.num_generations
        which = spec.WhichOneof("input")
        if which is None:
            return f"{at}: give `text` (used as is) or `question` (rendered with the run's template)", []
        value = getattr(spec, which)
        if not value.strip():
            return f"{at}.{which}: must not be empty", []
        if len(value) > lim.max_text_chars:
            return f"{at}.{which}: {len(value)} characters, limit {lim.max_text_chars} (prompts.max_text_chars)", []
        if len(spec.reference_answer) > lim.max_text_chars:
            return (f"{at}.reference_answer: {len(spec.reference_answer)} characters, limit {lim.max_text_chars} "
                    "(prompts.max_text_chars)"), []
        if spec.train and not spec.reference_answer.strip():
            return f"{at}.reference_answer: required when train is true (the rewards score against it)", []
        if len(spec.rewards) > MAX_REWARDS:
            return f"{at}.rewards: {len(spec.rewards)} names, limit {MAX_REWARDS}", []
        unknown = unknown_reward(spec.rewards, self.rewards)
        if unknown:
            return f"{at}.{unknown} (task.rewards and the built-ins; never an import path)", []
        if (bad := self._reference_problem(spec)) is not None:
            return f"{at}.{bad}", []
        most = min(lim.max_generations, self.cfg.largest_group())
        if not 0 <= spec.num_generations <= most:
            return (f"{at}.num_generations: {spec.num_generations} outside 0..{most} (prompts.max_generations, and "
                    "the rows a sampler can start as one group: sampler.rows_in_flight and the engine's slots; 0 = "
                    "the run's)"), []
        if spec.train and spec.num_generations not in (0, n_run):
            return (f"{at}.num_generations: a train=true prompt uses the run's generation.num_generations={n_run} "
                    "(the trainer's groups have one size); give 0 or set train=false"), []
        if not 0 <= spec.priority <= lim.max_priority:
            return f"{at}.priority: {spec.priority} outside 0..{lim.max_priority} (prompts.max_priority)", []
        if ceiling is not None and spec.priority > ceiling:
            return (f"{at}.priority: {spec.priority} above {ceiling}, this token's max_priority (its entry in the "
                    "token table); submit at or below it, or ask an admin to raise it"), []
        if len(spec.tags) > lim.max_tags:
            return f"{at}.tags: {len(spec.tags)} tags, limit {lim.max_tags} (prompts.max_tags)", []
        for k, tag in enumerate(spec.tags):
            if not 0 < len(tag) <= lim.max_tag_chars:
                return f"{at}.tags[{k}]: {len(tag)} characters, must be 1..{lim.max_tag_chars} (prompts.max_tag_chars)", []
            if not TAG.fullmatch(tag):
                return f"{at}.tags[{k}]: {tag!r} may hold letters, digits and . : / @ + - _ only", []
        ids = self.tokenizer.encode(self._render(spec))
        if not 0 < len(ids) <= self.cfg.generation.max_prompt_tokens:
            return (f"{at}.{which}: {len(ids)} tokens, must be 1..{self.cfg.generation.max_prompt_tokens} "
                    "(generation.max_prompt_tokens)"), []
        return None, ids

    def _reference_problem(self, spec: prompts_pb2.PromptSpec) -> str | None:
        """Why a reward could not check the prompt's reference_answer, or None: a reward comparing numbers given one
        that is no number, or an IFEval reward given what lm-eval's checks cannot read (refused here rather than
        every completion scored 0 on a sampler, without a word)."""
        scored_by = spec.rewards or self.cfg.task.rewards
        if not spec.reference_answer:
            return None
        if (bad := numeric_reference_problem(scored_by, spec.reference_answer)) or not any(
                name in TASK_REWARDS for name in scored_by):
            return bad
        from grpo_stream.common.tasks.ifeval_checks import reference_problem  # noqa: PLC0415 - lm-eval, IFEval only

        return reference_problem(spec.reference_answer)

    def Submit(self, request, context):
        caller = caller_of(context, self.table)
        count = len(request.prompts)
        if not 0 < count <= self.limits.max_batch:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompts: {count} given, must be 1..{self.limits.max_batch} (prompts.max_batch)")
        items, ids = [], []
        n_run = self.cfg.generation.num_generations
        for i, spec in enumerate(request.prompts):
            error, tokens = self._check(i, spec, caller.max_priority)
            if error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            pid = self.queue.new_id()
            spec.DiscardUnknownFields()  # protobuf writes back what it did not know: unchecked bytes, into Redis
            injected = rollout_pb2.InjectedPrompt(
                prompt_id=pid, prompt_token_ids=tokens, reference_answer=spec.reference_answer,
                rewards=list(spec.rewards), num_generations=spec.num_generations or n_run, train=spec.train)
            items.append((pid, spec.priority, injected.SerializeToString(), spec.SerializeToString(), spec.train,
                          list(spec.tags), injected.num_generations))
            ids.append(pid)
        try:
            queued = self.queue.submit(caller.name, items, self.limits.max_queued, self.limits.max_pending_per_client,
                                       self.limits.max_priority, self.limits.result_retention_s)
        except QueueFull as exc:
            context.set_trailing_metadata((("retry-after-ms", str(self.limits.retry_after_ms)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{exc}; retry after {self.limits.retry_after_ms} ms")
        except BufferUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prompt queue unavailable ({exc}); retry with backoff")
        log.info("%s (%s) queued %d prompts (%d train); queue %d", caller.name, caller.role, count,
                 sum(s.train for s in request.prompts), queued)
        return prompts_pb2.SubmitReply(prompt_ids=ids, queued=queued)

    # -- StreamResults ----------------------------------------------------------------------------------------------
    def _result(self, pid: str, record: dict[bytes, bytes]) -> prompts_pb2.PromptResult:
        """The client's view of a finished prompt's record; what a record no grpo-stream process wrote (a hand edit,
        a foreign tool) holds in place of a field is left empty, and a result that cannot be read is an `error`."""
        spec = _parsed(prompts_pb2.PromptSpec, record.get(b"spec", b"")) or prompts_pb2.PromptSpec()
        state = record[b"state"].decode()
        out = prompts_pb2.PromptResult(
            prompt_id=pid, state=state, tags=record_tags(record), train=record.get(b"train") == b"1",
            submitted_unix=_number(record.get(b"submitted")), finished_unix=_number(record.get(b"finished")),
            prompt_text=self._render(spec) if spec.WhichOneof("input") else "", policy_version=-1,
            error=record.get(b"error", b"").decode(errors="replace"))
        if state == "done":
            group = _parsed(rollout_pb2.RolloutGroup, record.get(b"result", b""))
            if group is None:
                out.error = "its result record in Redis is damaged (not the RolloutGroup the answer wrote)"
                return out
            out.policy_version, out.sampler_id, out.group_id = group.policy_version, group.sampler_id, group.group_id
            for c in group.completions:
                ids = np.frombuffer(c.token_ids_le, "<i4")
                out.completions.add(text=self.tokenizer.decode(ids.tolist()), reward=c.reward,
                                    reward_components=dict(c.reward_components), truncated=c.truncated,
                                    num_tokens=len(ids))
            out.reward_mean = float(np.mean([c.reward for c in group.completions])) if group.completions else 0.0
        return out

    def _finished(self, pids: list[str], summaries: list, tag: str | None = None, owner: str | None = None,
                  report_gone: bool = False):
        """Results of the prompts among `pids` that are finished (and carry `tag`, and were submitted by `owner`
        unless None), by their `summaries` (PromptQueue.summaries), in that order. Whole records (each holds its
        answer group) are read RECORDS_AT_ONCE at a time, so a follower of thousands holds a few in memory.
        `report_gone`: a prompt whose record left Redis before it was read (prompts.max_kept_results newer ones
        finished) is answered with an error saying so, never skipped (its follower waits for it)."""
        def wanted_one(s) -> bool:
            if s is None:
                return report_gone
            return s.get(b"state") in (b"done", b"cancelled") and (tag is None or tag in record_tags(s)) and (
                owner is None or s.get(b"client", b"").decode() == owner)

        wanted = [pid for pid, summary in zip(pids, summaries) if wanted_one(summary)]
        for start in range(0, len(wanted), RECORDS_AT_ONCE):
            chunk = wanted[start:start + RECORDS_AT_ONCE]
            for pid, record in zip(chunk, self.queue.records(chunk)):
                if isinstance(record, dict):  # (a key of another type: its summary was refused before)
                    yield self._result(pid, record)
                elif report_gone:
                    yield self._gone(pid)

    def _gone(self, pid: str) -> prompts_pb2.PromptResult:
        return prompts_pb2.PromptResult(
            prompt_id=pid, state="done", policy_version=-1,
            error=(f"finished, but its record left Redis before this stream read it: prompts.max_kept_results="
                   f"{self.limits.max_kept_results} newer prompts finished first (or prompts.result_retention_s "
                   "passed); its answer is lost to followers: raise prompts.max_kept_results, or follow sooner"))

    def StreamResults(self, request, context):
        """prompts.max_followers bounds these calls in the server's call gate (common/rpc/call_guard.py), which
        frees a follower's place as its call ends."""
        # a client follows its own prompts only (their answers are its data); an admin follows anyone's
        caller = caller_of(context, self.table)
        owner = None if caller.role == "admin" else caller.name
        # counted before any copy: a 64 MiB request of distinct ids made ~600 MiB of Python strings first
        if len(request.prompt_ids) > MAX_IDS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_ids: {len(request.prompt_ids)} given, limit "
                          f"{MAX_IDS}")
        ids, tag = list(dict.fromkeys(request.prompt_ids)), request.tag  # an id given twice is one result
        if bool(ids) == bool(tag):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "give either prompt_ids or tag")
        if tag and not (len(tag) <= self.limits.max_tag_chars and TAG.fullmatch(tag)):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"tag: not a valid tag (1..{self.limits.max_tag_chars} "
                          "letters, digits and . : / @ + - _)")
        try:
            after = self.queue.results_tail()  # before reading what is finished, so nothing falls in between
            if ids:
                summaries = self.queue.summaries(ids)
                self._check_ids(ids, summaries, owner, context)  # (refuses a key of another type, naming it)
                waiting = set(ids)
                for result in self._finished(ids, summaries, report_gone=True):
                    waiting.discard(result.prompt_id)
                    yield result
            else:
                waiting = None
                tagged = self.queue.tagged(tag)
                summaries = self._summaries(tagged)
                submitters = {s.get(b"client", b"").decode() for s in summaries if s is not None}
                # a one-shot query that could only come back empty says why; a follower is never refused for what
                # other clients tagged (tags are one namespace): it waits for its own prompts with the tag, which
                # it may submit after it starts, or which left Redis before it reconnected after a restart
                if owner is not None and not request.follow and submitters and owner not in submitters:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED, f"tag: {tag!r} is on other clients' prompts only; "
                                  "follow your own tags or prompt ids, or use an admin token")
                # oldest finish first; unfinished ones (no time) are left out by _finished
                order = sorted(range(len(tagged)), key=lambda k: _number((summaries[k] or {}).get(b"finished")))
                streamed = set()
                for result in self._finished([tagged[k] for k in order], [summaries[k] for k in order], owner=owner):
                    streamed.add(result.prompt_id)
                    yield result
                if not request.follow:
                    return
                # `streamed`: one that finished between reading the results' tail and the tag's prompts is in both
                # (the results stream holds each finish once: only these can come twice)
            while (waiting is None or waiting) and context.is_active():
                start = after
                after, finished = self.queue.wait_finished(after, FOLLOW_POLL_MS)
                if waiting is None:
                    new = [p for p in dict.fromkeys(finished) if p not in streamed]
                    yield from self._finished(new, self._summaries(new), tag=tag or None, owner=owner)
                    continue
                new = [p for p in dict.fromkeys(finished) if p in waiting]
                if self.queue.trimmed_past(start):  # finishes read too late (max_kept_results): their records say
                    new += sorted(waiting.difference(new))  # (a prompt whose record is gone is reported so)
                for result in self._finished(new, self._summaries(new), report_gone=True):
                    waiting.discard(result.prompt_id)  # (one still unfinished is not yielded: still waited for)
                    yield result
        except BufferUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prompt queue unavailable ({exc}); call again to resume")

    def _summaries(self, pids: list[str]) -> list:
        """PromptQueue.summaries with a key of another type read as no record: a tag's or a finish's id (grpo-stream
        wrote those) whose key was overwritten since is left out, or reported gone, not failing the stream."""
        return [None if s is NOT_A_HASH else s for s in self.queue.summaries(pids)]

    @staticmethod
    def _check_ids(ids: list[str], summaries: list, owner: str | None, context) -> None:
        """NOT_FOUND for an id with no record, PERMISSION_DENIED for another client's prompt (unless `owner` is
        None: an admin)."""
        for k, (pid, summary) in enumerate(zip(ids, summaries)):
            if summary is NOT_A_HASH:  # a follower can do nothing about it: an operator must
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, _foreign(f"prompt_ids[{k}]", pid))
            if summary is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"prompt_ids[{k}]: no prompt {pid[:64]!r} (unknown, or gone: "
                              "prompts.result_retention_s, prompts.max_kept_results)")
            if owner is not None and summary.get(b"client", b"").decode() != owner:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, f"prompt_ids[{k}]: {pid[:64]!r} was submitted by "
                              "another client; only its submitter or an admin may follow it")

    # -- Cancel, GetStatus ------------------------------------------------------------------------------------------
    def Cancel(self, request, context):
        caller = caller_of(context, self.table)
        if not 0 < len(request.prompt_ids) <= self.limits.max_batch:  # before any copy (StreamResults)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"prompt_ids: {len(request.prompt_ids)} given, must be "
                          f"1..{self.limits.max_batch} (prompts.max_batch)")
        ids = list(request.prompt_ids)
        try:
            states = self.queue.cancel(caller.name, caller.role == "admin", ids, self.limits.result_retention_s,
                                      self.limits.max_kept_results)
        except KeyError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, f"prompt_ids: no prompt {str(exc.args[0])[:64]!r}; nothing "
                          "was cancelled")
        except PermissionError as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"prompt_ids: {str(exc.args[0])[:64]!r} was submitted "
                          "by another client; only its submitter or an admin may cancel it (nothing was cancelled)")
        except ForeignKey as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, _foreign("prompt_ids", str(exc.args[0])) +
                          " (nothing was cancelled)")
        except BufferUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prompt queue unavailable ({exc}); retry with backoff")
        return prompts_pb2.CancelReply(cancelled=[p for p, s in states.items() if s == "cancelled"],
                                       finished=[p for p, s in states.items() if s == "finished"])

    def GetStatus(self, request, context):
        try:
            status = self.queue.read_status()
            queued, claimed = self.queue.counts()
            depth = self.queue.buffer_depth()
        except BufferUnavailable as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"status unavailable ({exc}); retry with backoff")
        reply = prompts_pb2.RunStatus(run_name=self.cfg.run.name, total_steps=self.cfg.trainer.steps,
                                      latest_weight_version=-1, buffer_depth=depth, injection_queued=queued,
                                      injection_claimed=claimed)
        fill_status(reply, status, self.queue.status_key)
        return reply


def record_tags(record: dict[bytes, bytes]) -> list[str]:
    """A prompt record's tags: Submit writes a JSON list of strings; anything else is no tags (as the scripts that
    finish and evict prompts read them, common/rollouts/kept_results.py)."""
    try:
        tags = json.loads(record.get(b"tags", b"[]"))
    except ValueError:
        return []
    return [tag for tag in tags if isinstance(tag, str)] if isinstance(tags, list) else []


def _foreign(field: str, pid: str) -> str:
    return (f"{field}: the Redis key of prompt {pid[:64]!r} is not a hash (something other than grpo-stream wrote "
            "it); delete the key, and submit the prompt again if it is still wanted")


def _parsed(message_type, raw: bytes):
    try:
        return message_type.FromString(raw)
    except DecodeError:
        return None


def _number(raw: bytes | None) -> float:
    try:
        return float(raw or 0)
    except ValueError:
        return 0.0
