"""The episode every tool environment runs: each model turn's tool calls are run and answered; a turn without a call
ends the episode."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from grpo_stream.common.environments.base import Observation, Turn
from grpo_stream.common.runtime.given_up import GivenUp, call_within
from grpo_stream.common.tools.calls import MalformedToolCall, parse_tool_calls
from grpo_stream.common.tools.functions import ToolSet

log = logging.getLogger(__name__)


def run_tool_format(cfg, tokenizer=None) -> str:
    """The run's tool format: environment.tool_format, else the one the model's tokenizer inferred from its chat
    template (HFTokenizer.tool_format; the tiny model's: 'plain')."""
    return cfg.environment.tool_format or getattr(tokenizer, "tool_format", None) or "plain"


def one_per_line(answers: list[str]) -> str:
    """The observation of several calls: their answers (or errors) in call order, one per line."""
    return "\n".join(answers)


@dataclasses.dataclass(frozen=True)
class TurnLimits:
    """What one model turn's tool calls may take (environment.max_calls_per_turn, environment.turn_tool_seconds): a
    turn of k calls would otherwise hold a worker k times each call's own wall limit."""

    max_calls: int = 8
    seconds: float = 30.0

    @classmethod
    def of(cls, cfg) -> "TurnLimits":
        return cls(cfg.environment.max_calls_per_turn, cfg.environment.turn_tool_seconds)


class ToolEpisode:
    """Calls in `tool_format` (common/tools/calls.py) are run by `tools`, within `limits`; `phrase` turns the answers
    (or the parser's error for a malformed call, alone) into the observation's text."""

    def __init__(self, tools: ToolSet, tool_format: str, phrase: Callable[[list[str]], str] = one_per_line,
                 limits: TurnLimits = TurnLimits()):
        self.tools, self.tool_format, self.phrase, self.limits = tools, tool_format, phrase, limits

    def step(self, turn_text: str) -> Turn:
        try:
            calls = parse_tool_calls(turn_text, self.tool_format)
        except MalformedToolCall as exc:
            return Turn(Observation(self.phrase([exc.message])))
        if not calls:
            return Turn(None)
        answers = self._run(calls)
        # the answers of several calls are each a tool message, as the template writes an OpenAI-style conversation's
        parts = tuple(answers) if self.phrase is one_per_line and len(answers) > 1 else ()
        return Turn(Observation(self.phrase(answers), parts=parts))

    def _run(self, calls: list) -> list[str]:
        """Each call's answer in call order; those past the turn's limits answered with an error, not run."""
        deadline, answers = time.monotonic() + self.limits.seconds, []
        for k, call in enumerate(calls):
            if k >= self.limits.max_calls:
                answers.append(f"error: at most {self.limits.max_calls} tool calls a turn "
                               "(environment.max_calls_per_turn); this one was not run")
            elif time.monotonic() >= deadline:
                answers.append(f"error: this turn's tool time ({self.limits.seconds:g} s, "
                               "environment.turn_tool_seconds) is spent; this call was not run")
            else:
                answers.append(self._run_until(call, deadline))
        return answers

    def _run_until(self, call, deadline: float) -> str:
        """The call's answer, or an error once `deadline` passes: a tool that hangs (a user-defined in-process one)
        held the worker, its episode and its group for ever. Given up, not stopped (common/runtime/given_up.py)."""
        try:
            return call_within(lambda: self.tools.run(call), deadline - time.monotonic(), f"tool-{str(call.name)[:32]}")
        except GivenUp:
            log.warning("tool %r did not answer within the turn's %g s (environment.turn_tool_seconds); given up",
                        str(call.name)[:64], self.limits.seconds)
            return (f"error: tool '{call.name}' did not answer within this turn's tool time "
                    f"({self.limits.seconds:g} s, environment.turn_tool_seconds); it was given up")
