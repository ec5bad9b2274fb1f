"""The generation-engine link: what a sampler generates with.

An engine serves requests (token-id prompts, each with its budget, its PRNG key and its sampling mode: greedy or the
policy's temperature) with the policy's parameters and hands back completions with the policy's per-token logprobs
(the behaviour logprobs the trainer's importance correction needs). `serve(params, source)` is the engine: it takes
requests from a `RequestSource` as they become ready and hands each finished sequence back, for as long as the source
is open (a sampler's rollout stream keeps one serve for its whole life, common/episodes/stream.py). `generate` is a
serve of a fixed request set. `refresh`, called at the engine's scheduling points, may return newer (params,
version): every live sequence continues with them, and each token records the version that drew it (in-flight
weight updates; an engine registered without in_flight_updates takes new weights only between serves). Engines are
chosen by sampler.engine in common/registry/engines.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import numpy as np


@dataclasses.dataclass
class Generation:
    tokens: np.ndarray      # [B, C] int32, pad after EOS
    logprobs: np.ndarray    # [B, C] float32, 0 after EOS
    lengths: np.ndarray     # [B] completion length, EOS included
    finished: np.ndarray    # [B] bool: ended with EOS
    versions: np.ndarray | None = None  # [B, C] int32: weight version that sampled each token (-1 after the end);
    # None: the engine generated every token with the params it was given


class GenerationEngine(Protocol):
    max_prompt_tokens: int
    max_new_tokens: int

    def serve(self, params: Any, source: "RequestSource", refresh: Callable | None = None, version: int = 0) -> None:
        """Decode the requests `source` hands out until it is closed and none is left, or it is cancelled."""

    def request_keys(self, rng: Any, rows: int) -> list:
        """The key of each row of a request set sampled with `rng` (a JAX key): what `generate` gives row i."""

    def generate(self, params: Any, prompts: list[list[int]], rng: Any, greedy: bool = False,
                 max_new_tokens: list[int] | None = None) -> Generation:
        """Completions of `prompts` (token ids, each at most max_prompt_tokens) with weights `params`, sampled at
        the configured temperature (`rng`: a JAX key) or greedy; `max_new_tokens`: per-row token budgets (default
        max_new_tokens for every row)."""


def decoded_rows_per_step(stats: dict) -> float | None:
    """Rows decoded per decode step, from the JAX engine's counters (`stats`, or their change over a span):
    live_slot_steps over decode_steps; None when no step was decoded."""
    return round(stats["live_slot_steps"] / stats["decode_steps"], 1) if stats.get("decode_steps") else None


def tokens_decoded(engine) -> int | None:
    """Tokens an engine made over its life (the JAX engine's live_slot_steps: a row cancelled or whose group failed
    included, which a caller counting the tokens it sent leaves out; a held turn's observation tokens, fed through
    decode steps, too); None for an engine that keeps no counters (vLLM)."""
    stats = getattr(engine, "stats", None) or {}
    return int(stats["live_slot_steps"]) if "live_slot_steps" in stats else None


def rows_decoding_mean(engine) -> float | None:
    """Rows an engine decoded per decode step, on average over its life: how full its callers kept it. From the
    counters an engine keeps in `stats` (the JAX engine's); None for an engine that keeps none (vLLM schedules inside
    itself)."""
    return decoded_rows_per_step(getattr(engine, "stats", None) or {})


def check_request(prompts: list[list[int]], budgets: list[int] | None, max_prompt_tokens: int,
                  max_new_tokens: int) -> np.ndarray:
    """Every engine's input check: each prompt 1..max_prompt_tokens tokens, each budget 1..max_new_tokens.
    Returns the per-row budgets (max_new_tokens for every row when `budgets` is None)."""
    for i, ids in enumerate(prompts):
        if not 0 < len(ids) <= max_prompt_tokens:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; generation.max_prompt_tokens={max_prompt_tokens}")
    if budgets is None:
        return np.full(len(prompts), max_new_tokens, np.int32)
    if len(budgets) != len(prompts) or not all(1 <= b <= max_new_tokens for b in budgets):
        raise ValueError(f"max_new_tokens: one budget per prompt, each in 1..{max_new_tokens} "
                         "(generation.max_new_tokens)")
    return np.asarray(budgets, np.int32)


def generate_by_serving(engine, params: Any, prompts: list[list[int]], rng: Any, greedy: bool,
                        max_new_tokens: list[int] | None, refresh, version: int) -> Generation:
    """An engine's `generate` as a `serve` of a fixed request set: row i samples with the engine's key for row i of
    `rng` (engine.request_keys), so a request served elsewhere with that key draws the same tokens."""
    budgets = check_request(prompts, max_new_tokens, engine.max_prompt_tokens, engine.max_new_tokens)
    rows, width = len(prompts), engine.max_new_tokens
    out = Generation(np.full((rows, width), engine.pad_id, np.int32), np.zeros((rows, width), np.float32),
                     np.zeros((rows,), np.int32), np.zeros((rows,), np.bool_),
                     None if refresh is None else np.full((rows, width), -1, np.int32))
    if rows:
        keys = engine.request_keys(rng, rows)
        requests = [Request(list(p), int(b), k, i, greedy=greedy)
                    for i, (p, b, k) in enumerate(zip(prompts, budgets, keys))]
        engine.serve(params, FixedRequests(requests, out), refresh, version)
    return out


class FirstWeights:
    """The weights a long serve starts with, handed to it through its callers (the sampler's loop, its engine
    thread, serve_sharing): the serve takes them (`take_weights`), so that once a newer version replaces them nothing
    keeps the first version alive for the serve's life (a whole extra copy of the weights on the device)."""

    def __init__(self, params: Any):
        self._params = params

    def take(self) -> Any:
        params, self._params = self._params, None
        if params is None:
            raise RuntimeError("a serve's first weights were taken already")
        return params


def take_weights(params: Any) -> Any:
    """`params` as a serve holds them: FirstWeights' taken from it, anything else as it is."""
    return params.take() if isinstance(params, FirstWeights) else params


@dataclasses.dataclass
class Request:
    """One sequence to decode: its prompt (for a later turn of an episode, the conversation so far, token ids as
    sampled and as the environment wrote them, never re-encoded), its budget of new tokens, its PRNG key data, the
    caller's handle, and how it samples: greedy, or the policy's temperature. Every request of one serve may sample
    its own way (a greedy evaluation probe or endpoint request rides beside the sampler's own rows)."""
    ids: list[int]
    budget: int
    key: Any
    tag: Any = None
    greedy: bool = False
    # multi-turn episodes on an engine that can hold a sequence's KV cache between turns (environment.kv_cache=hold):
    hold_key: Any = None             # keep this sequence's cache when it ends, under this key
    resume: Any = None               # continue the sequence held under this key: feed it `forced`, then sample
    forced: list[int] | None = None  # the ids that follow the held sequence: the last len(forced) of `ids`


def check_served(request: Request, max_new_tokens: int, context: int, vocab_size: int, context_field: str) -> Request:
    """`request` as every engine's serve takes it (check_request checks generate's prompts), else a ValueError
    naming the setting: a budget in 1..max_new_tokens, a prompt of 1 or more ids (and any forced ones) of the model's
    vocabulary, prompt + budget within the `context` tokens per sequence that `context_field` asked for (a later
    turn's prompt may pass max_prompt_tokens: the conversation so far). An id outside the vocabulary is never
    served: the JAX embedding lookup clamps it, and vLLM without a tokenizer checks none (one inside its padded rows
    decodes silently, one past them fails its step), so it would sample another prompt's completion and logprobs."""
    if not 1 <= request.budget <= max_new_tokens:
        raise ValueError(f"a request's budget of {request.budget} new tokens is outside 1..{max_new_tokens} "
                         "(generation.max_new_tokens); ask for fewer tokens or raise generation.max_new_tokens")
    if not len(request.ids):
        raise ValueError("a request has no prompt tokens: there is nothing to sample its first token from; send at "
                         "least one token id")
    if not all(0 <= min(ids) and max(ids) < vocab_size for ids in (request.ids, request.forced) if ids):
        raise ValueError(f"a request's token ids must lie in 0..{vocab_size - 1}, the model's vocabulary (forced ids "
                         "too); encode the prompt with the model's tokenizer")
    if len(request.ids) + request.budget > context:
        raise ValueError(f"a request of {len(request.ids)} prompt tokens and a budget of {request.budget} does not fit "
                         f"the engine's {context} tokens ({context_field}); shorten the prompt or its budget, or raise "
                         "that")
    return request


class RequestSource(Protocol):
    """Where a serving engine (`serve`) takes requests from and hands finished sequences back to."""

    def take(self) -> list[Request]:
        """Every request ready now (none: nothing is ready yet); never blocks."""

    def finish(self, request: Request, tokens: np.ndarray, logprobs: np.ndarray, versions: np.ndarray | None,
               finished: bool) -> None:
        """`request` ended: its sampled tokens (after `ids`, whether the engine resumed a held cache or prefilled
        them), their logprobs and versions (None: no in-flight updates), and whether it stopped at a stop token (else
        at its budget). Called on the engine's thread: must be quick."""

    def open(self) -> bool:
        """Whether requests may still come (an environment is answering an episode's turn)."""

    def wait(self, timeout: float) -> None:
        """Block until a request is ready, the source closes or `timeout` seconds pass."""

    def accepting(self) -> bool:
        """Whether work from outside the source (endpoint requests) may join the serve now; False while a sampler
        drains its stream for a weight install (only its own rollouts' requests are taken then)."""

    def released(self) -> list:
        """Hold keys (Request.hold_key) whose episodes ended since the last call: their held caches are freed."""

    def cancelled(self) -> bool:
        """Whether the caller gave up on every request it handed out: the serve ends at its next scheduling point,
        finishing none of them (a sampler stopping, or past its final version)."""


class FixedRequests:
    """A fixed request set whose results fill a Generation (row = request.tag): `generate` as a `serve`."""

    def __init__(self, requests: list[Request], out: Generation):
        self.requests, self.out = requests, out

    def take(self) -> list[Request]:
        taken, self.requests = self.requests, []
        return taken

    def finish(self, request: Request, tokens, logprobs, versions, finished: bool) -> None:
        row, n = request.tag, len(tokens)
        self.out.tokens[row, :n], self.out.logprobs[row, :n] = tokens, logprobs
        if versions is not None and self.out.versions is not None:
            self.out.versions[row, :n] = versions
        self.out.lengths[row], self.out.finished[row] = n, finished

    def open(self) -> bool:
        return False

    def wait(self, timeout: float) -> None:
        return None

    def accepting(self) -> bool:
        return True

    def released(self) -> list:
        return []

    def cancelled(self) -> bool:
        return False
