"""Rollouts of a `verifiers` environment (task.name=verifiers): the environment runs its own episodes, unchanged.

A group is `env.run_group` over `rows` copies of its dataset row, on an event loop of this kind's own thread; the
environment's model calls go to this process's OpenAI-compatible routes in memory (httpx's ASGI transport, the
internal token), whose requests join the same rollout stream as every other kind's turns (they are the stream's own
work: taken even while it drains, never refused for a full queue). The endpoint answers with the engine's token
ids and logprobs (`return_token_ids`) and continues each conversation from the ids it sampled
(common/endpoint/chat.py), so turn k+1's prompt ids start with turn k's prompt and completion ids: an episode is its
first prompt, then per turn the ids the environment's messages added (observation tokens, logprob 0, not trained
on) and the ids the model sampled. Each call carries its group's tag, under which the endpoint records the version
of every token it answered (common/endpoint/generation.py RolloutVersions): the trajectory does not keep them, and a
group is as stale as its oldest token. The rubric's weighted reward is the reward; its per-function scores are kept
as reward components. Each model turn is also decoded (stop tokens left out, as the other multi-turn kinds decode
theirs), so what the evaluation's accuracy, pass@k and maj@k read is the final turn's text (groups.py `answer_text`),
as for every kind: not a guess an earlier turn made before a tool answered.

A rollout the environment ended with an error (a model call that failed, a tool that raised and stopped it), whose
turns are not one token sequence, whose completion does not start with a token the model sampled (its first answer cut
at a stop string where it starts: the ingest would refuse the whole group), or whose rubric returned a non-finite
reward or metric (NaN, inf), fails (`EpisodeResult.failed`): its whole group is left out by the sampler (a partly
scored group would bias its advantages). So are the rows of a group whose rollouts began from different first prompts
(a group answers one prompt). An episode longer than generation.max_new_tokens is cut there
and marked truncated.
"""

from __future__ import annotations

import asyncio
import math
import threading
from typing import Any, Awaitable, Callable

from grpo_stream.common.endpoint.generation import ROLLOUT_FIELD, RolloutVersions
from grpo_stream.common.episodes.result import EpisodeResult
from grpo_stream.common.episodes.stream import GroupRun


class RolloutError(ValueError):
    """A rollout that cannot become a completion; the message says why."""


def episode_of(output: dict[str, Any], versions: dict) -> EpisodeResult:
    """One rollout's episode from its trajectory's token records and the versions the endpoint recorded."""
    steps = output.get("trajectory") or []
    if not steps:
        raise RolloutError("no model call")
    result = EpisodeResult(prompt_ids=[])
    for k, step in enumerate(steps):
        record = step.get("tokens")
        if not record:
            raise RolloutError(f"turn {k}: the endpoint's answer had no token ids")
        ids, sampled = list(record["prompt_ids"]), list(record["completion_ids"])
        drawn = versions.get(RolloutVersions.key(ids, sampled))
        if drawn is None or len(drawn) != len(sampled):
            raise RolloutError(f"turn {k}: the endpoint recorded no versions for its answer")
        if k == 0:
            result.prompt_ids = ids
        else:
            so_far = result.prompt_ids + result.tokens
            if ids[:len(so_far)] != so_far:
                raise RolloutError(f"turn {k}: its prompt does not continue the earlier turns' ids (the endpoint "
                                   "rendered the conversation anew)")
            result.add_observation(ids[len(so_far):])
        logprobs = [float(x) for x in record["completion_logprobs"]]
        if len(logprobs) != len(sampled):
            raise RolloutError(f"turn {k}: logprobs and token ids differ in length")
        result.add_turn(sampled, logprobs, drawn, closed=True)
    # what the ingest refuses in a completion, and with it the whole group, after the sampler counted it as sent: an
    # answer cut at a stop string (sampling_args `stop`) where it starts keeps no token
    if not result.model_mask or not result.model_mask[0]:
        raise RolloutError("no token the model sampled starts the completion (an answer cut at a stop string where it "
                           "starts keeps none); a completion starts with the model's tokens")
    return result


def _turn_texts(result: EpisodeResult, lengths: list[int], decode: Callable[[list[int]], str]) -> list[str]:
    """Each model turn's text (`lengths`: the turns' sampled ids, in order), of the ids kept after a cut: a turn cut
    off entirely has none."""
    model = [t for t, m in zip(result.tokens, result.model_mask) if m]
    texts, at = [], 0
    for n in lengths:
        if at >= len(model) and n:
            break
        texts.append(decode(model[at:at + n]))
        at += n
    return texts


def result_of(output: dict[str, Any], versions: dict, max_tokens: int,
              decode: Callable[[list[int]], str] | None = None) -> EpisodeResult:
    """The episode of one rollout, scored by its rubric; raises RolloutError. `decode`: a turn's ids as text (its
    turn_texts; None: not decoded)."""
    if output.get("error"):
        raise RolloutError(f"the environment reported {str(output['error'])[:300]}")
    result = episode_of(output, versions)
    cut = len(result.tokens) > max_tokens
    if cut:
        for name in ("tokens", "logprobs", "model_mask", "versions"):
            setattr(result, name, getattr(result, name)[:max_tokens])
    result.finished = not (cut or bool(output.get("is_truncated")))
    if decode is not None:
        lengths = [len(step["tokens"]["completion_ids"]) for step in output["trajectory"]]
        result.turn_texts = _turn_texts(result, lengths, decode)
    result.reward = float(output.get("reward") or 0.0)
    result.reward_components = {k: float(v) for k, v in (output.get("metrics") or {}).items()
                                if isinstance(v, (int, float))}
    # a NaN or infinite reward or metric would make the trainer's validate_group refuse the whole group (and its data
    # position be lost): failing the episode here leaves the group out through the sampler's failed-group path instead
    bad = {"reward": result.reward, **{f"metrics[{k!r}]": v for k, v in result.reward_components.items()}}
    bad = {k: v for k, v in bad.items() if not math.isfinite(v)}
    if bad:
        raise RolloutError(f"the rubric returned a non-finite reward ({', '.join(f'{k}={v}' for k, v in bad.items())})"
                           "; fix the environment's reward functions so that every score is a finite number")
    return result


async def group_results(run_group: Callable[[], Awaitable[Any]], rows: int, take_versions: Callable[[], dict],
                        max_tokens: int, timeout_s: float,
                        decode: Callable[[list[int]], str] | None = None) -> list[EpisodeResult]:
    """The `rows` episodes of one group from `run_group()` (the environment's), each scored or failed with why.
    Every row gets a result and nothing escapes: an environment that raises, runs past `timeout_s`
    (task.verifiers.group_timeout_s; it is cancelled), ends cancelled by something else (it awaited what another task
    cancelled) or returns outputs not shaped as episodes fails its rows, so the
    group ends and its rows go back to the stream instead of holding the sampler's capacity for ever.
    `take_versions()` (the endpoint's record of the group's token versions) is called once whatever happens;
    `decode`: result_of's."""
    async def called():  # what run_group() raises before it awaits is the task's too
        return await run_group()

    outputs, failed = None, None
    call = asyncio.ensure_future(called())
    try:
        done, _ = await asyncio.wait({call}, timeout=timeout_s)
    except BaseException:  # this coroutine itself was cancelled (a stop): the environment's run goes, the record too
        call.cancel()
        take_versions()
        raise
    if not done:
        call.cancel()
        failed = f"run_group ran past task.verifiers.group_timeout_s={timeout_s:g}s and was cancelled"
    elif call.cancelled():  # it awaited what another task cancelled: exception() would raise CancelledError here
        failed = "run_group was cancelled (by something other than task.verifiers.group_timeout_s)"
    elif call.exception() is not None:
        exc = call.exception()
        failed = f"run_group raised {type(exc).__name__}: {exc}"
    else:
        outputs = call.result()
        if not isinstance(outputs, list) or len(outputs) != rows:
            got = len(outputs) if isinstance(outputs, list) else type(outputs).__name__
            failed = f"run_group returned {got} outputs for {rows} rows"
    versions = take_versions()
    results = []
    for row in range(rows):
        try:
            if failed:
                raise RolloutError(failed)
            results.append(result_of(outputs[row], versions, max_tokens, decode))
        except Exception as exc:  # noqa: BLE001 - an environment's output fails its episode, never the sampler
            why = str(exc) if isinstance(exc, RolloutError) else (
                f"the environment's output is not an episode ({type(exc).__name__}: {exc})")
            results.append(EpisodeResult(failed=why[:500]))
    return _one_prompt(results)


def _one_prompt(results: list[EpisodeResult]) -> list[EpisodeResult]:
    """`results`, or every row failed when the rows began from different first prompts (an environment that varies
    its prompt per rollout, e.g. a random system prompt or few-shot example): a group is one prompt's completions,
    and the group builder's refusal of such a group stopped the sampler instead of leaving the group out."""
    firsts = {tuple(r.prompt_ids) for r in results if not r.failed and r.prompt_ids is not None}
    if len(firsts) <= 1:
        return results
    why = (f"the group's rollouts began from {len(firsts)} different first prompts (the environment varies its "
           "prompt between rollouts of one row); a group's completions must answer one prompt")
    return [r if r.failed else EpisodeResult(failed=why) for r in results]


class VerifiersRollouts:
    """The rollout kind of task.name=verifiers: `env` runs each group against the routes `app` (with `token`);
    `versions`: the endpoint core's RolloutVersions; `decode`: a turn's ids as text (result_of)."""

    _decode: Callable[[list[int]], str] | None = None

    def __init__(self, env, app, token: str, model: str, sampling_args: dict[str, Any], max_tokens: int,
                 timeout_s: float, versions: RolloutVersions, group_timeout_s: float,
                 decode: Callable[[list[int]], str] | None = None):
        import httpx  # noqa: PLC0415 - deferred: the `verifiers` extra
        import verifiers as vf  # noqa: PLC0415 - deferred: as above
        from openai import AsyncOpenAI  # noqa: PLC0415 - deferred: as above

        self.env, self.model, self.max_tokens, self.sampling_args = env, model, max_tokens, sampling_args
        self.versions, self.group_timeout_s, self._decode = versions, group_timeout_s, decode
        self.environment_seconds = 0.0  # the environment's own time is inside its rollouts: not measured apart
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="verifiers-rollouts", daemon=True)
        self._thread.start()
        transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=timeout_s)
        self._http = AsyncOpenAI(base_url="http://sampler/v1", api_key=token, max_retries=0, timeout=timeout_s,
                                 http_client=transport)
        self._client = vf.OpenAIChatCompletionsClient(self._http)

    def start(self, run: GroupRun) -> None:
        self.versions.open(run.work.group_id)
        asyncio.run_coroutine_threadsafe(self._group(run), self._loop)

    async def _group(self, run: GroupRun) -> None:
        work = run.work
        args = dict(self.sampling_args)
        args["extra_body"] = {**dict(args.get("extra_body") or {}), ROLLOUT_FIELD: work.group_id}
        if work.greedy:
            args["temperature"] = 0.0
        why = "the group's rollouts ended before their results were made"
        try:
            results = await group_results(
                lambda: self.env.run_group([work.problem.row] * work.rows, self._client, self.model, args,
                                           state_columns=["trajectory"]),
                work.rows, lambda: self.versions.take(work.group_id), self.max_tokens, self.group_timeout_s,
                self._decode)
            for row, result in enumerate(results):
                run.episode_done(row, result)
        except BaseException as exc:  # re-raised: this only says why in the rows' results below
            why = f"the group's rollouts ended with {type(exc).__name__}: {exc}"[:500]
            raise
        finally:  # every row ends, whatever happened: a row never reported would keep its group in flight for ever
            for row in range(work.rows):
                if run.results[row] is None:
                    run.episode_done(row, EpisodeResult(failed=why))

    def close(self) -> None:
        future = asyncio.run_coroutine_threadsafe(self._http.close(), self._loop)
        try:
            future.result(timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():  # its selector's descriptors go now, not when the collector gets to it
                self._loop.close()


def build(cfg, task, tokenizer, routes) -> VerifiersRollouts:
    """The rollout registry's entry (verifiers): the run's sampling (the engine's temperature, a turn's token budget,
    logprobs and token ids on) under task.verifiers.sampling_args, against `routes` (InProcessRoutes)."""
    gen, extra = cfg.generation, dict(cfg.task.verifiers.sampling_args)
    sampling = {"temperature": gen.temperature, "max_tokens": cfg.environment.turn_max_new_tokens or gen.max_new_tokens,
                "logprobs": True}
    sampling.update({k: v for k, v in extra.items() if k != "extra_body"})
    sampling["extra_body"] = {**dict(extra.get("extra_body") or {}), "return_token_ids": True}
    stops = set(tokenizer.eos_ids)
    return VerifiersRollouts(task.env, routes.app, routes.token, routes.model_name, sampling, gen.max_new_tokens,
                             cfg.sampler.openai.request_timeout_s, routes.versions,
                             cfg.task.verifiers.group_timeout_s,
                             decode=lambda ids: tokenizer.decode([t for t in ids if t not in stops]))
