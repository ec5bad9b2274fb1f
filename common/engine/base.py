"""The generation-engine link: what a sampler generates with.

An engine takes a batch of token-id prompts and the policy's parameters and returns completions with the policy's
per-token logprobs (the behaviour logprobs the trainer's importance correction needs). Every engine switches to a
new weight version when it is handed new parameters between batches; an engine registered with in_flight_updates
(registry.py) also takes `refresh` and `version`: it calls refresh() at its scheduling points, switches to the
(params, version) it returns for every live sequence, and records in Generation.versions the version of each token
(sampler.weight_updates=in_flight). Engines are chosen by sampler.engine in registry.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

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
    fixed_shape: bool  # True: batches must keep one shape (one compiled program per shape); callers pad them

    def generate(self, params: Any, prompts: list[list[int]], rng: Any, greedy: bool = False,
                 max_new_tokens: list[int] | None = None) -> Generation:
        """Completions of `prompts` (token ids, each at most max_prompt_tokens) with weights `params`, sampled at
        the configured temperature (`rng`: a JAX key) or greedy; `max_new_tokens`: per-row token budgets (default
        max_new_tokens for every row)."""


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
