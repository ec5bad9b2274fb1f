"""Serving the OpenAI-compatible endpoint's requests on the sampler's engine: requests -> sequences on the engine's
side queue (common/engine/side_requests.py) -> `chat.completion` and `text_completion` answers.

Each choice of a request is one engine sequence whose key is fold_in(key(seed), i) (i: the choice's index across
the request), the key the engine's own `generate` gives row i of a batch generated with key(seed), so a seeded
request returns exactly what the engine generates. Stop strings are applied to the finished text (the engine stops
at the model's stop tokens only): the answer's text, token ids and logprobs end at the token that completes the
first stop string, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import codecs
import hashlib
import json
import math
import secrets
import threading
import time
import uuid
from typing import Any

import jax
import numpy as np

from grpo_stream.common.engine.side_requests import SideQueue, SideRequest
from grpo_stream.common.tools.calls import MalformedToolCall, parse_tool_calls
from grpo_stream.common.endpoint.chat import ChatPrompts, template_messages
from grpo_stream.common.endpoint.protocol import (ROLLOUT_FIELD, ChatRequest, CompletionRequest, RequestError,
                                                  UnknownModel)

INTERNAL = "sampler-internal"  # the caller name of the process's own rollouts (app.py)
CALL_OPENINGS = {"qwen": "<tool_call>", "gemma": "```tool_code", "plain": "<call>", "llama3": ""}
# the least logprob answered (OpenAI's own for a token of no probability): a token the policy gives probability 0 at
# its temperature has -inf, which JSON cannot write (Python writes -Infinity, which the openai SDK fails to read)
LOGPROB_FLOOR = -9999.0


def wire_logprobs(logprobs) -> list[float]:
    """`logprobs` as answered: finite ones as they are, down to LOGPROB_FLOOR; -inf, NaN and any less at the floor
    (and +inf, which no log-probability is, at 0)."""
    return [x if LOGPROB_FLOOR <= x < math.inf else 0.0 if x == math.inf else LOGPROB_FLOOR
            for x in map(float, logprobs)]


class Unavailable(RuntimeError):
    """The engine could not answer (it failed, or the sampler is stopping): answered 503."""


def sequence_keys(engine, seed: int | None, count: int) -> list:
    """The keys of a request's `count` sequences: those the engine gives the rows of a batch it generates with
    key(seed) (a random seed when none is asked for)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):  # never queued behind an accelerator's work
        return engine.request_keys(jax.random.key(secrets.randbits(31) if seed is None else seed), count)


def cut_at_stop(tokenizer, tokens: list[int], stops: list[str]) -> tuple[int, str, bool]:
    """(tokens kept, their text, whether a stop string ended them): the shortest token prefix whose text holds a
    stop string, its text cut before that string; all tokens and their text when none occurs."""
    text = tokenizer.decode(tokens)
    if not stops or not any(s in text for s in stops):
        return len(tokens), text, False
    low, high = 1, len(tokens)  # a prefix holding a stop string keeps holding it as it grows: bisect
    while low < high:
        mid = (low + high) // 2
        if any(s in tokenizer.decode(tokens[:mid]) for s in stops):
            high = mid
        else:
            low = mid + 1
    kept = tokenizer.decode(tokens[:low])
    return low, kept[:min(kept.index(s) for s in stops if s in kept)], True


class RolloutVersions:
    """The weight version of every token answered to the process's own rollouts (a `verifiers` group's model calls,
    tagged with ROLLOUT_FIELD), which a trajectory does not keep and the group builder needs (a group is as stale as
    its oldest token; with in-flight updates one answer may mix versions). Kept per group until it is taken, when the
    group ends; keyed by the answer's prompt and completion ids."""

    def __init__(self):
        self._by_group: dict[str, dict[tuple[bytes, bytes], list[int]]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(prompt_ids: list[int], completion_ids: list[int]) -> tuple[bytes, bytes]:
        return (hashlib.sha256(np.asarray(prompt_ids, np.int64).tobytes()).digest(),
                hashlib.sha256(np.asarray(completion_ids, np.int64).tobytes()).digest())

    def open(self, group: str) -> None:
        with self._lock:
            self._by_group[group] = {}

    def record(self, group: str, prompt_ids: list[int], completion_ids: list[int], versions: list[int]) -> None:
        with self._lock:
            found = self._by_group.get(group)
            if found is None:  # a group that ended (or never opened) keeps nothing
                return
            key = self.key(prompt_ids, completion_ids)
            # two rows may answer the same ids under different versions (an install between them): their records
            # share a key, and keeping each token's older version keeps the group as stale as its oldest token
            earlier = found.get(key)
            found[key] = list(versions) if earlier is None else [min(a, b) for a, b in zip(earlier, versions)]

    def take(self, group: str) -> dict[tuple[bytes, bytes], list[int]]:
        with self._lock:
            return self._by_group.pop(group, {})


class EndpointCore:
    """What the HTTP routes call: token ids in, engine sequences, answers out."""

    def __init__(self, engine, queue: SideQueue, tokenizer, model_name: str, context_tokens: int, max_new_tokens: int,
                 temperature: float, tool_format: str, max_n: int, timeout_s: float,
                 max_prompt_chars: int | None = None):
        """`context_tokens`: the endpoint's context (sampler.openai.max_context_tokens, or the rollouts' prompt +
        completion), which the engine's KV capacity per sequence must hold."""
        capacity = getattr(engine, "context_capacity", context_tokens)
        if context_tokens > capacity:
            raise ValueError(f"sampler.openai.max_context_tokens={context_tokens} exceeds this engine's KV capacity of "
                             f"{capacity} tokens per sequence; lower it to {capacity} or less (engines built from the "
                             "run's config hold it)")
        self.engine, self.queue, self.tokenizer, self.model_name = engine, queue, tokenizer, model_name
        # 16 characters a token of the longest prompt it takes (the context less a completion's room)
        self.max_prompt_chars = max_prompt_chars or 16 * max(1, context_tokens - max_new_tokens)
        self.context_tokens, self.max_new_tokens, self.temperature = context_tokens, max_new_tokens, temperature
        self.tool_format, self.max_n, self.timeout_s = tool_format, max_n, timeout_s
        self.chat_prompts = ChatPrompts(tokenizer, tool_format=tool_format)
        self.rollout_versions = RolloutVersions()
        self.stopping: str | None = None  # why requests are answered 503 now (`stop`)

    def stop(self, why: str) -> None:
        """Answer every request waiting for the engine, and every later one, 503 with `why` (the sampler is stopping:
        no serve will take them)."""
        self.stopping = why
        self.queue.fail_waiting(why)

    def _check_model_and_n(self, request) -> None:
        if request.model != self.model_name:
            raise UnknownModel(f"model={request.model!r}: this endpoint serves {self.model_name!r} (GET /v1/models)")
        if request.n > self.max_n:
            raise RequestError(f"n={request.n}: at most sampler.openai.max_n={self.max_n}")

    def _check_chars(self, chars: int, where: str) -> None:
        """Refuse a prompt by its characters before it is tokenized (tokenizing megabytes holds the GIL for seconds:
        every other request and the sampler's own decoding wait)."""
        if chars > self.max_prompt_chars:
            raise RequestError(f"{where}: {chars} characters, at most sampler.openai.max_prompt_chars="
                               f"{self.max_prompt_chars} (the context is {self.context_tokens} tokens)")

    def _budget(self, request, prompts: list[list[int]], where: str, default: int | None) -> int:
        """The new-token budget of every sequence, checked with its prompt against the endpoint's context
        (sampler.openai.max_context_tokens; later turns of a conversation are longer prompts)."""
        context = self.context_tokens
        longest = max(len(ids) for ids in prompts)
        if min(len(ids) for ids in prompts) == 0:
            raise RequestError(f"{where}: encodes to no tokens; send a non-empty prompt")
        # worded as vLLM words it: clients (verifiers, agent loops) recognise it and end an episode as truncated;
        # checked before each id is, which is then at most the context's worth
        if longest >= context:
            raise RequestError(f"{where}: this model's maximum context length is {context} tokens "
                               f"(sampler.openai.max_context_tokens); the prompt has {longest}")
        for ids in prompts:
            if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
                raise RequestError(f"{where}: token ids must lie in 0..{self.tokenizer.vocab_size - 1}")
        budget = request.budget(self.max_new_tokens, default or min(self.max_new_tokens, context - longest))
        if longest + budget > context:
            raise RequestError(f"{request.budget_field()}={budget}: this model's maximum context length is {context} "
                               f"tokens and the prompt has {longest}; ask for at most {context - longest}")
        return budget

    async def _generate(self, prompts: list[list[int]], n: int, greedy: bool, budget: int,
                        seed: int | None, owned: bool = False) -> list[SideRequest]:
        """Queue n sequences per prompt and wait for all of them; `owned`: the process's own rollouts' (never
        refused for a full queue: the rollout stream sizes their work itself)."""
        loop = asyncio.get_running_loop()
        keys = sequence_keys(self.engine, seed, len(prompts) * n)
        waits, sequences = [], []
        for i, key in enumerate(keys):
            done = loop.create_future()
            notify = (lambda fut: lambda: loop.call_soon_threadsafe(
                lambda: fut.done() or fut.set_result(None)))(done)
            sequence = SideRequest(ids=list(prompts[i // n]), budget=budget, key=key, greedy=greedy, notify=notify,
                                   owned=owned)
            sequences.append(sequence)
            waits.append(done)
        self.queue.submit(sequences)  # all or none (QueueFull)
        if self.stopping:  # checked after submitting: a stop between a check and a submit would leave them waiting
            self.queue.withdraw(sequences)
            raise Unavailable(self.stopping)
        # asyncio.wait rather than a gather: a gather cancelled with its handler (its client left: app.py) would log
        # "exception was never retrieved"
        try:
            _, late = await asyncio.wait(waits, timeout=self.timeout_s)
            if late:
                raise asyncio.TimeoutError
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.queue.withdraw(sequences)
            raise
        failed = next((s.error for s in sequences if s.error), None)
        if failed:
            raise Unavailable(failed)
        return sequences

    def completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        """The ids of a completion request's prompts: texts as vLLM encodes them (with add_special_tokens, the
        default, what the tokenizer's post-processor adds, e.g. Llama 3's BOS), token ids as given."""
        encode = self.tokenizer.encode_with_special_tokens if request.add_special_tokens else self.tokenizer.encode
        return [encode(p) if isinstance(p, str) else list(p) for p in request.prompts()]

    def _completion_work(self, request: CompletionRequest) -> tuple[list[list[int]], bool, int]:
        """(prompt ids, greedy, budget) of a checked completion request."""
        self._check_model_and_n(request)  # first, as OpenAI and vLLM check it: another model's fields are not ours
        request.check()
        if len(request.prompts()) * request.n > self.max_n:
            raise RequestError(f"prompt: {len(request.prompts())} prompts x n={request.n} sequences; at most "
                               f"sampler.openai.max_n={self.max_n} per request")
        self._check_chars(sum(len(p) for p in request.prompts() if isinstance(p, str)), "prompt")
        prompts = self.completion_prompts(request)
        greedy = request.greedy(self.temperature)
        return prompts, greedy, self._budget(request, prompts, "prompt", 16)

    async def completion(self, request: CompletionRequest, caller: str = "") -> dict[str, Any]:
        # checking, tokenizing and writing the answer run off the event loop: a body of a million prompts or ids, or
        # n long choices with logprobs, took seconds of it, every other client of the endpoint waiting
        prompts, greedy, budget = await asyncio.to_thread(self._completion_work, request)
        sequences = await self._generate(prompts, request.n, greedy, budget, request.seed, caller == INTERNAL)
        return await asyncio.to_thread(self._completion_answer, request, caller, prompts, sequences)

    def _completion_answer(self, request: CompletionRequest, caller: str, prompts: list[list[int]],
                           sequences: list[SideRequest]) -> dict[str, Any]:
        rollout = self._rollout(request, caller)
        choices = []
        for i, seq in enumerate(sequences):
            kept, text, stopped = cut_at_stop(self.tokenizer, seq.tokens, request.stop)
            if rollout is not None:
                self.rollout_versions.record(rollout, seq.ids, seq.tokens[:kept], seq.versions[:kept])
            choice = {"index": i, "text": text, "finish_reason": _finish(seq, stopped, kept),
                      "logprobs": self._completion_logprobs(seq, kept) if request.logprobs is not None else None,
                      "policy_version": seq.version, "completion_tokens": kept}
            if request.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = seq.ids, seq.tokens[:kept]
            choices.append(choice)
        return self._answer("text_completion", "cmpl", choices, prompts, request.n, sequences)

    def _chat_work(self, request: ChatRequest, caller: str) -> tuple[list, list | None, list[int], bool, int]:
        """(templated messages, tools, prompt ids, greedy, budget) of a checked chat request."""
        self._check_model_and_n(request)  # first, as OpenAI and vLLM check it: another model's fields are not ours
        request.check()
        messages = self.chat_prompts.defused(template_messages(request.messages))
        tools = request.tools or None
        self._check_chars(sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)
                          + len(json.dumps(tools or [], ensure_ascii=False)), "messages")
        ids = self.chat_prompts.ids(messages, tools, caller)
        greedy = request.greedy(self.temperature)
        return messages, tools, ids, greedy, self._budget(request, [ids], "messages", None)

    async def chat(self, request: ChatRequest, caller: str = "") -> dict[str, Any]:
        messages, tools, ids, greedy, budget = await asyncio.to_thread(self._chat_work, request, caller)  # as above
        sequences = await self._generate([ids], request.n, greedy, budget, request.seed, caller == INTERNAL)
        return await asyncio.to_thread(self._chat_answer, request, caller, messages, tools, ids, sequences)

    def _chat_answer(self, request: ChatRequest, caller: str, messages: list, tools: list | None, ids: list[int],
                     sequences: list[SideRequest]) -> dict[str, Any]:
        as_ids = bool((request.model_extra or {}).get("return_tokens_as_token_ids"))
        rollout = self._rollout(request, caller)
        choices = []
        for i, seq in enumerate(sequences):
            kept, text, stopped = cut_at_stop(self.tokenizer, seq.tokens, request.stop)
            if rollout is not None:
                self.rollout_versions.record(rollout, ids, seq.tokens[:kept], seq.versions[:kept])
            message, calls = self._message(text, tools if request.tool_choice != "none" else None)
            choice = {"index": i, "message": message,
                      "finish_reason": "tool_calls" if calls else _finish(seq, stopped, kept),
                      "logprobs": {"content": self._chat_logprobs(seq, kept, as_ids)} if request.logprobs else None,
                      "policy_version": seq.version, "completion_tokens": kept}
            if request.return_token_ids:
                choice["token_ids"] = seq.tokens[:kept]
            choices.append(choice)
            # an answer cut at a stop string ends in ids of text the client never saw (the stop string): remembered,
            # the next turn's prompt would hold that text though the client sent it back without it
            if not stopped:
                closed = kept == len(seq.tokens) and seq.finished
                self.chat_prompts.remember(messages, message, tools, ids + seq.tokens[:kept], closed, caller)
        answer = self._answer("chat.completion", "chatcmpl", choices, [ids], request.n, sequences)
        if request.return_token_ids:
            answer["prompt_token_ids"] = ids
        return answer

    @staticmethod
    def _rollout(request, caller: str) -> str | None:
        """The rollout group an internal request's model call belongs to (ROLLOUT_FIELD; ignored from others)."""
        tag = (request.model_extra or {}).get(ROLLOUT_FIELD) if caller == INTERNAL else None
        return tag if isinstance(tag, str) else None

    def _message(self, text: str, tools) -> tuple[dict[str, Any], bool]:
        """The assistant message of a choice: with tools listed, the calls it makes as `tool_calls`."""
        calls = []
        if tools:
            try:
                calls = parse_tool_calls(text, self.tool_format)
            except MalformedToolCall:
                calls = []  # the text is returned as it is: the caller sees what the model wrote
        if not calls:
            return {"role": "assistant", "content": text}, False
        opening = CALL_OPENINGS[self.tool_format]
        content = text[:text.index(opening)].strip() if opening and opening in text else ""
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(
                           {**dict(c.arguments), **({"_positional": list(c.positional)} if c.positional else {})})}}
                      for c in calls]
        return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, True

    def _chat_logprobs(self, seq: SideRequest, kept: int, as_ids: bool) -> list[dict[str, Any]]:
        """OpenAI's per-token logprobs; `bytes` are the token's own (tokenizer.token_bytes), so a character split
        over tokens (CJK, emoji) is rebuilt from them, where its text alone is U+FFFD. A special token (the stop
        token) is its own text, as vLLM writes it: decoded, it was "" beside `bytes` that held it."""
        out = []
        for token, logprob in zip(seq.tokens[:kept], wire_logprobs(seq.logprobs[:kept])):
            text = f"token_id:{token}" if as_ids else (
                self.tokenizer.decode([token]) or self.tokenizer.token_bytes(token).decode("utf-8", "replace"))
            out.append({"token": text, "logprob": logprob, "bytes": list(self.tokenizer.token_bytes(token)),
                        "top_logprobs": []})
        return out

    def _completion_logprobs(self, seq: SideRequest, kept: int) -> dict[str, Any]:
        """`text_offset`: where each token starts in the completion's text, in characters, counted from the
        tokens' bytes (a character split over tokens starts at the token holding its first byte)."""
        tokens = [self.tokenizer.decode([t]) for t in seq.tokens[:kept]]
        utf8, offsets, written = codecs.getincrementaldecoder("utf-8")(errors="replace"), [], 0
        for token in seq.tokens[:kept]:
            offsets.append(written)
            written += len(utf8.decode(self.tokenizer.token_bytes(token)))
        return {"tokens": tokens, "token_logprobs": wire_logprobs(seq.logprobs[:kept]), "top_logprobs": None,
                "text_offset": offsets}

    def _answer(self, kind: str, prefix: str, choices: list, prompts: list[list[int]], n: int,
                sequences: list[SideRequest]) -> dict[str, Any]:
        completion_tokens = sum(c.pop("completion_tokens") for c in choices)
        prompt_tokens = sum(len(p) for p in prompts)
        versions = [s.version for s in sequences]
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": self.model_name, "system_fingerprint": f"policy-v{min(versions)}", "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


def _finish(seq: SideRequest, stopped: bool, kept: int) -> str:
    return "stop" if stopped or (seq.finished and kept == len(seq.tokens)) else "length"
