"""Reward functions: pure functions of (completion text, reference answer) -> float.

A run's rewards are a mapping from a reward to its weight (config
`task.rewards`); the total reward of a completion is the weighted sum and each
component is kept by name. A reward is either a built-in name below or an
import path `package.module:function` to a function with the same signature,
so users plug in their own without touching grpo-stream. Accuracy is always
`answer_correct`, whatever the weights.

Only the operator's config may name an import path: an injected prompt (read
from the network or from Redis) may ask for a subset of the run's rewards by
name, resolved by `RunRewards` from the built-ins and the functions the
config already resolved, never by importing a name it carries (an import runs
the module's code: `os:system` from Redis would run on every sampler).
"""

from __future__ import annotations

import collections
import importlib
import re
from typing import Collection, Iterable, Mapping, Sequence

from grpo_stream.common.registry.base import Registry
from grpo_stream.common.registry.rewards import BUILTIN_REWARDS
from grpo_stream.common.rollouts.wire import MAX_ABS_REWARD
from grpo_stream.common.tasks.answers import (extract_answer, hashes_answer, last_number as last_number_in, parse_number,
                                              same_number)
from grpo_stream.common.tasks.base import RewardFn, reply
from grpo_stream.common.tasks.ifeval_checks import ifeval_loose, ifeval_strict

_WHITESPACE = re.compile(r"\s*")
_REASONING, _REASONING_END, _ANSWER, _ANSWER_END = "<reasoning>", "</reasoning>", "<answer>", "</answer>"


def answer_correct(text: str, reference: str) -> float:
    """1.0 when the completion's final answer (any supported format) equals the reference number, else 0.0."""
    got = extract_answer(text)
    return 1.0 if got is not None and same_number(got, reference) else 0.0


def last_number(text: str, reference: str) -> float:
    """1.0 when the last number the completion writes equals the reference number, else 0.0: the answer of a chat
    reply (task.prompt_template=chat), which states it in prose rather than as `#### N`."""
    got = last_number_in(text)
    return 1.0 if got is not None and same_number(got, reference) else 0.0


def answer_format(text: str, reference: str) -> float:
    """1.0 when the completion states a numeric answer as `#### N` (GSM8K's format; read as `answer_correct` reads
    it: a markdown heading `#### Step 1` is not one), else 0.0."""
    del reference
    return 1.0 if hashes_answer(text) is not None else 0.0


def reasoning_answer_format(text: str, reference: str) -> float:
    """1.0 when the completion's reply (base.reply: a reasoning model's thinking before it) is exactly
    `<reasoning>...</reasoning><answer>...</answer>` (the Tunix demo format)."""
    del reference
    return 1.0 if _reasoning_then_answer(reply(text)) else 0.0


def _reasoning_then_answer(text: str) -> bool:
    """Whether `^\\s*<reasoning>.+?</reasoning>\\s*<answer>.+?</answer>\\s*$` (re.S) matches `text`, in linear
    time: the pattern tried every `</reasoning>` against the rest of the text for a closing `</answer>`, 11 s on
    256k characters of `<reasoning>x</reasoning><answer>` repeated. The text, stripped (str.strip and the pattern's
    \\s: the same whitespace), opens with `<reasoning>` and closes with `</answer>`; some `</reasoning>` after at
    least one character of reasoning is followed by whitespace, `<answer>` and at least one character of answer."""
    text = text.strip()
    if not (text.startswith(_REASONING) and text.endswith(_ANSWER_END)):
        return False
    body = text[len(_REASONING):len(text) - len(_ANSWER_END)]
    at = body.find(_REASONING_END, 1)
    while at >= 0:
        opened = _WHITESPACE.match(body, at + len(_REASONING_END)).end()
        if body.startswith(_ANSWER, opened) and len(body) > opened + len(_ANSWER):
            return True
        at = body.find(_REASONING_END, at + 1)
    return False


# the reward registry: built-in rewards by name (task.rewards also takes `package.module:function`), one function
# of this module per name of common/registry/rewards.py's table (which the config checks names against)
_FUNCTIONS = {fn.__name__: fn for fn in (answer_correct, answer_format, last_number, reasoning_answer_format,
                                          ifeval_strict, ifeval_loose)}
REWARDS: Registry[RewardFn] = Registry("task.rewards", "reward", {
    name: _FUNCTIONS[spec.function] for name, spec in BUILTIN_REWARDS.items()})
DEFAULT_WEIGHTS = {"answer_correct": 1.0, "answer_format": 0.1}
NUMERIC_REWARDS = ("answer_correct", "last_number")  # built-ins that read the reference answer as a number


def numeric_reference_problem(names: Iterable[str], reference: str) -> str | None:
    """Why `reference` cannot be scored by the rewards `names` (a reward comparing numbers, given one that is no
    number: every completion would score 0 on it, without a word), or None."""
    numeric = sorted(name for name in names if name in NUMERIC_REWARDS)
    if not numeric or parse_number(reference) is not None:
        return None
    return (f"reference_answer: {reference[:40]!r} is not a number, and {', '.join(numeric)} compare the "
            "completion's number with it; send the answer as a number (e.g. '42', '-3.5', '3/4')")
TASK_REWARDS = {"ifeval_strict": "ifeval", "ifeval_loose": "ifeval"}  # built-ins offered only to that task's runs


class RewardError(ValueError):
    """A reward raised, or returned a non-finite value, on one completion, or the weighted total is past the ingest's
    +-MAX_ABS_REWARD (`reward`: its largest term); `reward` names it. Never scored 0: a
    sampler leaves the completion's group out (sampler_service/group_sink.py), so a reward that fails on every input
    stops the run after a few groups instead of training on zeros."""

    def __init__(self, reward: str, message: str):
        super().__init__(message)
        self.reward = reward


class UnknownReward(ValueError):
    """A reward name outside the run's (built-ins and task.rewards): refused, never imported."""


def allowed_names(configured: Iterable[str], task_name: str | None = None) -> list[str]:
    """The reward names a prompt may ask for, sorted: the run's own (task.rewards, which the operator wrote) and the
    built-ins, less those that belong to another task than `task_name` (TASK_REWARDS: the IFEval checks read an
    IFEval reference, parse it and run lm-eval's code on what a client sent; a run of another task never offers
    them)."""
    offered = {n for n in REWARDS if TASK_REWARDS.get(n, task_name) == task_name}
    return sorted(offered | set(configured))


def unknown_reward(names: Iterable[str], allowed: Collection[str]) -> str | None:
    """`rewards[k]: 'name' is not one of this run's rewards [...]` for the first of `names` outside `allowed` (the
    name cut to 64 characters: it may come from anyone), else None."""
    for k, name in enumerate(names):
        if name not in allowed:
            return f"rewards[{k}]: {name[:64]!r} is not one of this run's rewards {sorted(allowed)}"
    return None


def resolve(name: str) -> RewardFn:
    """A built-in reward by name, or the function at import path `package.module:function`. Imports: call it on
    the operator's config only (task.rewards), never on a name read from the network or Redis (`RunRewards`)."""
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

    def __init__(self, weights: dict[str, float], functions: Mapping[str, RewardFn] | None = None):
        """`weights` from the operator's config (import paths are imported); `functions`: already resolved
        functions by name to take instead (every name of `weights` must be there, or be a built-in)."""
        if not weights:
            raise ValueError("task.rewards: give at least one reward, e.g. {answer_correct: 1.0}")
        self.configured = dict(weights)  # the rewards asked for, as asked (evaluation says which it scored by)
        # answer_correct is always computed (weight 0 when not listed): it is the accuracy the trainer reports
        self.weights = {"answer_correct": 0.0, **weights}
        self.functions = {name: resolve(name) if functions is None else functions.get(name, REWARDS.get(name))
                          for name in self.weights}
        missing = [name for name, fn in self.functions.items() if fn is None]
        if missing:
            raise UnknownReward(f"rewards: {missing[0][:64]!r} was not resolved")

    def score(self, text: str, reference: str, call=None) -> tuple[float, dict[str, float]]:
        """Total weighted reward and each component by name; a reward that raises or returns a non-finite
        value is a RewardError naming it (a bad user reward must not be silently scored 0). `call(name, fn, text,
        reference)` runs each reward (reward_workers.RewardWorker.call: in a worker with a deadline); None: here."""
        components = {}
        for name, fn in self.functions.items():
            try:
                value = float(fn(text, reference) if call is None else call(name, fn, text, reference))
            except Exception as exc:  # noqa: BLE001 - re-raised with the reward's name
                raise RewardError(name, f"task.rewards.{name[:64]} raised {type(exc).__name__}: {str(exc)[:300]}; "
                                  "a reward must return a number for every completion (0.0 for text it cannot "
                                  "read)") from exc
            if value != value or value in (float("inf"), float("-inf")):
                raise RewardError(name, f"task.rewards.{name[:64]} returned {value}; rewards must be finite")
            components[name] = value
        total = sum(self.weights[n] * v for n, v in components.items())
        if not abs(total) <= MAX_ABS_REWARD:  # finite components can overflow (1e308 x 2), or pass the ingest's bound
            name = max(components, key=lambda n: abs(self.weights[n] * components[n]))
            raise RewardError(name, f"task.rewards: the total {total} (task.rewards.{name[:64]} = {components[name]} "
                              f"x {self.weights[name]:g}) is not within +-{MAX_ABS_REWARD:g}, which the trainer "
                              "refuses (the advantage estimators work in float32); scale the rewards down")
        return total, components


def scored_by(weights: Mapping[str, float]) -> str:
    """What an evaluation's `reward` is, for a log line: 'reward by task.rewards (answer_correct x1 + answer_format
    x0.1)'; with no weights (a verifiers environment scores its own episodes) its rubric."""
    if not weights:
        return "reward by the environment's rubric"
    return "reward by task.rewards (" + " + ".join(f"{name} x{weight:g}" for name, weight in weights.items()) + ")"


class RunRewards:
    """A run's rewards (`default`: task.rewards, resolved once from the operator's config) and the subsets injected
    prompts ask for by name. A subset is made of the built-ins and the functions `default` already resolved: a name
    outside them raises UnknownReward and nothing is imported. The last `max_cached` subsets are kept (a prompt
    stream naming many orders of the names must not grow a sampler's memory)."""

    def __init__(self, default: RewardSet, configured: Mapping[str, float], max_cached: int = 32,
                 task_name: str | None = None):
        self.default, self.configured, self.max_cached = default, dict(configured), max_cached
        self.allowed = allowed_names(default.functions, task_name)
        self.functions = {n: fn for n, fn in {**REWARDS, **default.functions}.items() if n in self.allowed}
        self.cached: collections.OrderedDict[tuple[str, ...], RewardSet] = collections.OrderedDict()

    def subset(self, names: Sequence[str]) -> RewardSet:
        """The run's rewards (no names), or the named ones at the run's weight (1 for a built-in the run does not
        weight). UnknownReward for a name outside the run's."""
        if not names:
            return self.default
        key = tuple(dict.fromkeys(names))
        found = self.cached.get(key)
        if found is None:
            error = unknown_reward(names, self.allowed)
            if error:
                raise UnknownReward(error)
            found = RewardSet({n: self.configured.get(n, 1.0) for n in key}, self.functions)
            self.cached[key] = found
            while len(self.cached) > self.max_cached:
                self.cached.popitem(last=False)
        self.cached.move_to_end(key)
        return found


def score(text: str, reference: str, weights: dict[str, float] = DEFAULT_WEIGHTS) -> tuple[float, dict[str, float]]:
    """Total weighted reward and each component, by name (resolves `weights` on each call; see RewardSet)."""
    return RewardSet(weights).score(text, reference)
