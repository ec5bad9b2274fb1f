"""The generation-engine link: what a sampler generates with.

An engine takes a batch of token-id prompts and the policy's parameters and returns completions with the policy's
per-token logprobs (the behaviour logprobs the trainer's importance correction needs). Every engine switches to a
new weight version only when it is handed new parameters between batches, so the sampler's version and staleness
rules do not depend on the engine. Engines are chosen by sampler.engine in registry.py.
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


class GenerationEngine(Protocol):
    max_prompt_tokens: int
    max_new_tokens: int
    fixed_shape: bool  # True: batches must keep one shape (one compiled program per shape); callers pad them

    def generate(self, params: Any, prompts: list[list[int]], rng: Any, greedy: bool = False) -> Generation:
        """Completions of `prompts` (token ids, each at most max_prompt_tokens) with weights `params`, sampled at
        the configured temperature (`rng`: a JAX key) or greedy."""
