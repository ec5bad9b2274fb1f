"""What the vLLM engine's serve keeps of each request in the engine (`Live`), and how it ends one early: a request
whose endpoint caller went away (`drop_withdrawn`), or one vLLM ended itself (`check_ended`); the seed it samples with
(`seed_of` its key). Each request is checked first as every engine checks it (base.check_served, naming
CONTEXT_FIELD)."""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from grpo_stream.common.engine.base import Request


CONTEXT_FIELD = "generation.max_prompt_tokens + generation.max_new_tokens, or sampler.openai.max_context_tokens " \
                "when longer"  # max_model_len


class Live:
    """A request in the engine: what it has produced so far (`per_step`: outputs come a step's tokens at a time,
    each recorded under the version that sampled it; else once, whole, when it ends)."""

    def __init__(self, request: Request, index: int | None, per_step: bool):
        self.request, self.index = request, index
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] | None = [] if per_step else None

    def add(self, out, version: int) -> None:
        self.tokens += out.token_ids
        self.logprobs += [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)]
        if self.versions is not None:
            self.versions += [version] * len(out.token_ids)


def drop_withdrawn(source, pending: collections.deque, live: dict, engine) -> None:
    """Endpoint requests whose caller went away (side_requests.MergedSource.withdrawn; other sources have none):
    aborted in vLLM and dropped here rather than decoded to their budget for nobody."""
    withdrawn = getattr(source, "withdrawn", None)
    gone = {id(r) for r in withdrawn()} if withdrawn is not None else None
    if gone:
        kept = [r for r in pending if id(r.tag) not in gone]
        pending.clear()
        pending.extend(kept)
        ids = [rid for rid, entry in live.items() if id(entry.request.tag) in gone]
        for rid in ids:
            del live[rid]
        if ids:
            engine.abort_request(ids)


def check_ended(out) -> None:
    """A request vLLM ended itself ("abort": the engine dropped it; "error": a request-level failure) has not
    ended its completion: recorded as cut at the budget, its partial tokens would be scored and trained as a
    truncated completion. The serve fails instead, naming the request (its claim goes back; the sampler's
    restart rules apply)."""
    reason = str(out.outputs[0].finish_reason)
    if reason in ("abort", "error"):
        raise RuntimeError(f"vLLM ended request {out.request_id} with finish_reason={reason!r}: an engine-side "
                           "failure, not the end of the completion (see the vLLM engine's log)")


def seed_of(rng: Any) -> int:
    """A request's vLLM seed from a JAX PRNG key (its raw bits), a key's data (a serving request's key) or an int."""
    if isinstance(rng, (int, np.integer)):
        return int(rng)
    if isinstance(rng, np.ndarray) and rng.dtype == np.uint32:
        bits = rng.astype(np.uint64).ravel()
    else:
        bits = np.asarray(jax.random.key_data(rng)).astype(np.uint64).ravel()
    return int(bits[0] << np.uint64(32) | bits[-1]) & (2**63 - 1)
