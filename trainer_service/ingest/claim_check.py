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


def checked_claim(queue: PromptQueue, raw: list[bytes], allowed: Collection[str], retention_s: int,
                  max_kept: int) -> list[rollout_pb2.InjectedPrompt]:
    """The claimed prompts (InjectedPrompt bytes) that name only `allowed` rewards; each other one is finished now
    as refused (raises BufferUnavailable when Redis is down: the claim lease then queues it again, to be refused
    at the next claim). A record that is not an InjectedPrompt is left out (its id is unknown here)."""
    prompts, refused = [], {}
    for blob in raw:
        try:
            prompt = rollout_pb2.InjectedPrompt.FromString(blob)
        except DecodeError:
            log.warning("a claimed injected prompt is not an InjectedPrompt (written to Redis by hand?); skipped")
            continue
        error = unknown_reward(prompt.rewards, allowed)
        if error is None:
            prompts.append(prompt)
        else:
            refused[prompt.prompt_id] = (f"{error} (task.rewards and the built-ins); refused by the ingest: the "
                                         "prompt reached the queue without PromptService.Submit's checks")
    if refused:
        def record_errors():
            pipe = queue.client.pipeline(transaction=False)
            for pid, error in refused.items():
                pipe.hset(queue.prompt_key(pid), "error", error)
            return pipe.execute()
        redis_call(record_errors)  # before the cancel, so a follower woken by it reads the error
        queue.cancel(REFUSER, True, list(refused), retention_s, max_kept)
        for pid, error in refused.items():
            log.warning("injected prompt %r refused: %s", pid[:64], error[:300])
    return prompts
