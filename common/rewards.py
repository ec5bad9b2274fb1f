"""Reward functions: pure functions of (completion text, reference answer) -> float.

A reward spec is a name and a weight; the total reward of a completion is
the weighted sum. Accuracy is always `answer_correct`, unweighted.
"""

from __future__ import annotations

import re
from typing import Callable

_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def extract_answer(text: str) -> str | None:
    """The number after the first `####`, commas removed; None when absent."""
    match = _ANSWER.search(text)
    if match is None:
        return None
    return match.group(1).replace(",", "")


def _same_number(x: str, y: str) -> bool:
    try:
        return float(x) == float(y)
    except ValueError:
        return x.strip() == y.strip()


def answer_correct(text: str, reference: str) -> float:
    """1.0 when the `#### N` answer equals the reference number, else 0.0."""
    got = extract_answer(text)
    return 1.0 if got is not None and _same_number(got, reference) else 0.0


def answer_format(text: str, reference: str) -> float:
    """1.0 when the completion states an answer as `#### N`."""
    del reference
    return 0.0 if extract_answer(text) is None else 1.0


REWARD_FUNCTIONS: dict[str, Callable[[str, str], float]] = {
    "answer_correct": answer_correct,
    "answer_format": answer_format,
}

DEFAULT_WEIGHTS = {"answer_correct": 1.0, "answer_format": 0.1}


def score(text: str, reference: str, weights: dict[str, float] = DEFAULT_WEIGHTS) -> tuple[float, dict[str, float]]:
    """Total weighted reward and each component, by name."""
    components = {name: REWARD_FUNCTIONS[name](text, reference) for name in weights}
    return sum(weights[n] * v for n, v in components.items()), components
