"""A generation batch of a `verifiers` environment's rollouts as scored rollout groups (task.name=verifiers).

The environment runs its own rollouts, unchanged: `env.run_group` over `rows` copies of a dataset row (one per
completion of the group), its model calls going to this sampler's OpenAI-compatible endpoint on loopback, its rubric
scoring them. The endpoint answers with the engine's token ids and logprobs (`return_token_ids`), and continues
each conversation from the ids it sampled (sampler_service/openai_chat.py), so turn k+1's prompt ids start with turn
k's prompt and completion ids: an episode is its first prompt, then per turn the ids the environment's messages added
(observation tokens, logprob 0, not trained on) and the ids the model sampled. The group's reward is the rubric's
weighted reward; its per-function scores are kept as reward components.

A rollout the environment ended with an error (a model call that failed, a tool that raised and stopped it), or
whose turns are not one token sequence, fails its whole group: logged and not sent (a partly scored group would
bias its advantages). An episode longer than generation.max_new_tokens is cut there and marked truncated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np

from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.common.tasks.registry import task_spec

log = logging.getLogger(__name__)
MAX_FAILED_IN_A_ROW = 64  # groups failed one after another before the sampler stops (a wrong setup, not bad luck)


class RolloutError(ValueError):
    """A rollout that cannot become a completion; the message says why."""


def episode_of(output: dict[str, Any]) -> tuple[list[int], list[int], list[float], list[bool]]:
    """(prompt ids, completion ids, logprobs, model mask) of one rollout from its trajectory's token records."""
    steps = output.get("trajectory") or []
    if not steps:
        raise RolloutError("no model call")
    prompt: list[int] = []
    tokens: list[int] = []
    logprobs: list[float] = []
    mask: list[bool] = []
    for k, step in enumerate(steps):
        record = step.get("tokens")
        if not record:
            raise RolloutError(f"turn {k}: the endpoint's answer had no token ids")
        ids = list(record["prompt_ids"])
        if k == 0:
            prompt = ids
        else:
            so_far = prompt + tokens
            if ids[:len(so_far)] != so_far:
                raise RolloutError(f"turn {k}: its prompt does not continue the earlier turns' ids (the endpoint "
                                   "rendered the conversation anew)")
            observation = ids[len(so_far):]
            tokens += observation
            logprobs += [0.0] * len(observation)
            mask += [False] * len(observation)
        sampled = list(record["completion_ids"])
        tokens += sampled
        logprobs += [float(x) for x in record["completion_logprobs"]]
        mask += [True] * len(sampled)
    if len(logprobs) != len(tokens):
        raise RolloutError("logprobs and token ids differ in length")
    return prompt, tokens, logprobs, mask


def completion_of(output: dict[str, Any], max_tokens: int) -> tuple[list[int], CompletionData]:
    """(prompt ids, the completion) of one rollout; raises RolloutError."""
    if output.get("error"):
        raise RolloutError(f"the environment reported {str(output['error'])[:300]}")
    prompt, tokens, logprobs, mask = episode_of(output)
    cut = len(tokens) > max_tokens
    if cut:
        tokens, logprobs, mask = tokens[:max_tokens], logprobs[:max_tokens], mask[:max_tokens]
    metrics = {k: float(v) for k, v in (output.get("metrics") or {}).items() if isinstance(v, (int, float))}
    return prompt, CompletionData(token_ids=np.asarray(tokens, np.int32), logprobs=np.asarray(logprobs, np.float32),
                                  reward=float(output.get("reward") or 0.0),
                                  truncated=cut or bool(output.get("is_truncated")), reward_components=metrics,
                                  model_mask=np.asarray(mask, np.bool_))


class VerifiersRollouts:
    """Runs a batch's groups on the environment against this sampler's endpoint (its routes `app`, `token`)."""

    def __init__(self, env, app, token: str, model: str, sampling_args: dict[str, Any], max_tokens: int,
                 timeout_s: float):
        import httpx  # noqa: PLC0415
        import verifiers as vf  # noqa: PLC0415 - the `verifiers` extra
        from openai import AsyncOpenAI  # noqa: PLC0415

        self.env, self.model, self.max_tokens, self.sampling_args = env, model, max_tokens, sampling_args
        # one event loop and one client for the sampler's life. The client reaches the endpoint's routes in this
        # process (httpx's ASGI transport): the same routes, token and checks as over HTTP, without a socket, so a
        # TLS setup whose certificate names another host changes nothing here
        self._loop = asyncio.new_event_loop()
        transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=timeout_s)
        self._http = AsyncOpenAI(base_url="http://sampler/v1", api_key=token, max_retries=0, timeout=timeout_s,
                                 http_client=transport)
        self._client = vf.OpenAIChatCompletionsClient(self._http)
        self.failed_groups = self._failed_in_a_row = 0

    def run(self, slots, policy_version: int, sampler_id: str) -> list[GroupData]:
        """The groups of `slots` (each slot's problem has the dataset row; slot.rows completions each); groups whose
        rollouts failed are logged and left out. Raises when the last MAX_FAILED_IN_A_ROW groups all failed (the
        environment or the run's settings are wrong: generating more would fail the same way)."""
        return self._loop.run_until_complete(self._run(slots, policy_version, sampler_id))

    async def _run(self, slots, policy_version: int, sampler_id: str) -> list[GroupData]:
        outputs = await asyncio.gather(*(self.env.run_group(
            [slot.problem.row] * slot.rows, self._client, self.model, dict(self.sampling_args),
            state_columns=["trajectory"]) for slot in slots), return_exceptions=True)
        groups = []
        for slot, outs in zip(slots, outputs):
            try:
                if isinstance(outs, BaseException):
                    raise RolloutError(f"run_group raised {type(outs).__name__}: {outs}")
                groups.append(self._group(slot, outs, policy_version, sampler_id))
                self._failed_in_a_row = 0
            except RolloutError as exc:
                self.failed_groups += 1
                self._failed_in_a_row += 1
                log.warning("%s: group %s not sent: %s", sampler_id, slot.group_id, str(exc)[:500])
                if self._failed_in_a_row >= MAX_FAILED_IN_A_ROW:
                    raise ValueError(f"task.verifiers: the last {self._failed_in_a_row} groups all failed, the last "
                                     f"with: {str(exc)[:500]}; fix the environment or the run's settings") from None
        return groups

    def close(self) -> None:
        self._loop.run_until_complete(self._http.close())
        self._loop.close()

    def _group(self, slot, outs: list[dict], policy_version: int, sampler_id: str) -> GroupData:
        made = [completion_of(out, self.max_tokens) for out in outs]
        prompts = {tuple(p) for p, _ in made}
        if len(prompts) != 1:
            raise RolloutError("its rollouts started from different prompt ids")
        return GroupData(group_id=slot.group_id, prompt_id=slot.problem.prompt_id,
                         prompt_token_ids=np.asarray(made[0][0], np.int32), completions=[c for _, c in made],
                         policy_version=policy_version, sampler_id=sampler_id, created_unix=time.time(),
                         reference_answer=slot.problem.answer, data_position=slot.position,
                         injected=slot.position is None)


def verifiers_rollouts(cfg, task, endpoint) -> VerifiersRollouts | None:
    """The sampler's verifiers driver (None unless task.name=verifiers): the run's sampling (the engine's temperature,
    a turn's token budget, logprobs and token ids on) under task.verifiers.sampling_args."""
    if not task_spec(cfg.task.name).own_rollouts:
        return None
    gen, extra = cfg.generation, dict(cfg.task.verifiers.sampling_args)
    sampling = {"temperature": gen.temperature, "max_tokens": cfg.environment.turn_max_new_tokens or gen.max_new_tokens,
                "logprobs": True}
    sampling.update({k: v for k, v in extra.items() if k != "extra_body"})
    sampling["extra_body"] = {**dict(extra.get("extra_body") or {}), "return_token_ids": True}
    return VerifiersRollouts(task.env, endpoint.app, endpoint.internal_token, endpoint.core.model_name, sampling,
                             gen.max_new_tokens, cfg.sampler.openai.request_timeout_s)
