"""The episode every tool environment runs: each model turn's tool calls are run and answered; a turn without a call
ends the episode."""

from __future__ import annotations

from typing import Callable

from grpo_stream.common.environments.base import Observation, Turn
from grpo_stream.common.tools.calls import MalformedToolCall, parse_tool_calls
from grpo_stream.common.tools.functions import ToolSet


def one_per_line(answers: list[str]) -> str:
    """The observation of several calls: their answers (or errors) in call order, one per line."""
    return "\n".join(answers)


class ToolEpisode:
    """Calls in `tool_format` (common/tools/calls.py) are run by `tools`; `phrase` turns the answers (or the parser's
    error for a malformed call, alone) into the observation's text."""

    def __init__(self, tools: ToolSet, tool_format: str, phrase: Callable[[list[str]], str] = one_per_line):
        self.tools, self.tool_format, self.phrase = tools, tool_format, phrase

    def step(self, turn_text: str) -> Turn:
        try:
            calls = parse_tool_calls(turn_text, self.tool_format)
        except MalformedToolCall as exc:
            return Turn(Observation(self.phrase([exc.message])))
        if not calls:
            return Turn(None)
        return Turn(Observation(self.phrase([self.tools.run(call) for call in calls])))
