"""Reward functions: pure functions of (completion text, reference answer) -> float.

A run's rewards are a mapping from a reward to its weight (config
`task.rewards`); the total reward of a completion is the weighted sum and each
component is kept by name. A reward is either a built-in name below or an
import path `package.module:function` to a function with the same signature,
so users plug in their own without touching grpo-stream. Accuracy is always
`answer_correct`, whatever the weights.
"""

from __future__ import annotations

import importlib
import re

from grpo_stream.common.tasks.answers import extract_answer, parse_number, same_number
from grpo_stream.common.tasks.base import RewardFn

_REASONING_ANSWER = re.compile(r"^\s*<reasoning>.+?</reasoning>\s*<answer>.+?</answer>\s*$", re.S)


def answer_correct(text: str, reference: str) -> float:
    """1.0 when the completion's final answer (any supported format) equals the reference number, else 0.0."""
    got = extract_answer(text)
    return 1.0 if got is not None and same_number(got, reference) else 0.0


def answer_format(text: str, reference: str) -> float:
    """1.0 when the completion states a numeric answer as `#### N` (GSM8K's format)."""
    del reference
    match = re.search(r"####[ \t]*([^\n]*)", text)
    return 1.0 if match and parse_number(match.group(1).split()[0] if match.group(1).split() else "") is not None \
        else 0.0


def reasoning_answer_format(text: str, reference: str) -> float:
    """1.0 when the completion is exactly `<reasoning>...</reasoning><answer>...</answer>` (the Tunix demo format)."""
    del reference
    return 1.0 if _REASONING_ANSWER.match(text) else 0.0


# the reward registry: built-in rewards by name (task.rewards also takes `package.module:function`)
REWARDS: dict[str, RewardFn] = {
    "answer_correct": answer_correct,
    "answer_format": answer_format,
    "reasoning_answer_format": reasoning_answer_format,
}
DEFAULT_WEIGHTS = {"answer_correct": 1.0, "answer_format": 0.1}


def resolve(name: str) -> RewardFn:
    """A built-in reward by name, or the function at import path `package.module:function`."""
    if name in REWARDS:
        return REWARDS[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"task.rewards.{name}: not a built-in reward ({', '.join(REWARDS)}) nor an import path "
                         "'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"task.rewards.{name}: cannot import it ({type(exc).__name__}: {exc})") from exc
    if not callable(fn):
        raise ValueError(f"task.rewards.{name}: {type(fn).__name__} is not callable")
    return fn


class RewardSet:
    """Weighted rewards resolved once; `score` is what samplers call per completion."""

    def __init__(self, weights: dict[str, float]):
        if not weights:
            raise ValueError("task.rewards: give at least one reward, e.g. {answer_correct: 1.0}")
        # answer_correct is always computed (weight 0 when not listed): it is the accuracy the trainer reports
        self.weights = {"answer_correct": 0.0, **weights}
        self.functions = {name: resolve(name) for name in self.weights}

    def score(self, text: str, reference: str) -> tuple[float, dict[str, float]]:
        """Total weighted reward and each component by name; a reward that raises or returns a non-finite
        value is an error naming it (a bad user reward must not be silently scored 0)."""
        components = {}
        for name, fn in self.functions.items():
            try:
                value = float(fn(text, reference))
            except Exception as exc:  # noqa: BLE001 - re-raised with the reward's name
                raise ValueError(f"task.rewards.{name} raised {type(exc).__name__}: {exc}") from exc
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"task.rewards.{name} returned {value}; rewards must be finite")
            components[name] = value
        return sum(self.weights[n] * v for n, v in components.items()), components


def score(text: str, reference: str, weights: dict[str, float] = DEFAULT_WEIGHTS) -> tuple[float, dict[str, float]]:
    """Total weighted reward and each component, by name (resolves `weights` on each call; see RewardSet)."""
    return RewardSet(weights).score(text, reference)
