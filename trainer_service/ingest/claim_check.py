"""What the ingest hands a sampler from the injected-prompt queue: only prompts whose reward names are the run's.

PromptService.Submit refuses other names, but the queue lives in Redis, which someone else may write: a prompt there
naming a reward outside the run's (an import path such as `os:system`, which a sampler once imported) is finished at
once, as cancelled with an `error` that its client reads in the result (PromptResult.error), so it is never handed
out, never generated and never queued again by the claim lease. The sampler checks the names once more
(sampler_service/group_source.py) and imports nothing either way.
"""

from __future__ import annotations

import logging
from typing import Collection

from google.protobuf.message import DecodeError

from grpo_stream.common.rollouts.redis_errors import redis_call
from grpo_stream.common.tasks.rewards import unknown_reward
from grpo_stream.protos import rollout_pb2
from grpo_stream.trainer_service.ingest.prompt_queue import PromptQueue

log = logging.getLogger(__name__)
REFUSER = "ingest"  # the caller name the refusal is made under (an admin's cancel: any client's prompt)


def checked_claim(queue: PromptQueue, raw: list[tuple[str, bytes]], allowed: Collection[str], retention_s: int,
                  max_kept: int) -> list[rollout_pb2.InjectedPrompt]:
    """The claimed prompts ((prompt id, InjectedPrompt bytes) pairs) that name only `allowed` rewards; each other
    one, and each whose record is damaged (not an InjectedPrompt, or one of another id), is finished now as refused,
    under its key's id (raises BufferUnavailable when Redis is down: the claim lease then queues it again, to be
    refused at the next claim)."""
    prompts, refused = [], {}
    for pid, blob in raw:
        try:
            prompt = rollout_pb2.InjectedPrompt.FromString(blob)
        except DecodeError:
            prompt = None
        if prompt is None or not blob or prompt.prompt_id != pid:
            refused[pid] = ("its queued record in Redis is damaged (req is not the InjectedPrompt submitted as this "
                            "id; written by hand?): refused by the ingest; submit it again")
            continue
        error = unknown_reward(prompt.rewards, allowed)
        if error is None:
            prompts.append(prompt)
        else:
            refused[pid] = (f"{error} (task.rewards and the built-ins); refused by the ingest: the prompt reached "
                            "the queue without PromptService.Submit's checks")
    if refused:
        _refuse(queue, refused, retention_s, max_kept)
    return prompts


def _refuse(queue: PromptQueue, refused: dict[str, str], retention_s: int, max_kept: int) -> None:
    """Finish each of `refused` (id -> error) as cancelled with its error, which its client reads in the result."""
    def record_errors():
        pipe = queue.client.pipeline(transaction=False)
        for pid, error in refused.items():
            pipe.hset(queue.prompt_key(pid), "error", error)
        return pipe.execute()
    redis_call(record_errors)  # before the cancel, so a follower woken by it reads the error
    ids = list(refused)
    while ids:  # a cancel is all or nothing: one that cannot be cancelled is left out, the others still are
        try:
            queue.cancel(REFUSER, True, ids, retention_s, max_kept)
            break
        except KeyError as exc:  # a hash with no submitter (written by hand): left to the claim lease, max_claims
            log.warning("injected prompt %r has no submitter in Redis: not cancelled; the claim lease gives it up "
                        "after prompts.max_claims leases", str(exc.args[0])[:64])
            ids.remove(exc.args[0])
    for pid, error in refused.items():
        log.warning("injected prompt %r refused: %s", pid[:64], error[:300])
