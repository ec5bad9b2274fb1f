"""The multi-turn CPU demo's environment: addition problems with a calculator tool (`add`).

A model turn that calls the tool (`<call>add(a, b)</call>`, the 'plain' tool format) is answered with the sum
(` = c`); a malformed call with ` = error`; a turn without a call ends the episode, and its last `#### N` is the
answer the run's rewards score. The tiny model's tokenizer is trained on this text (common/tasks/arith_tools.py).
"""

from __future__ import annotations

from grpo_stream.common.environments.base import Observation, Turn
from grpo_stream.common.tasks.arith_tools import TOOL_NAME, result_text
from grpo_stream.common.tools.calls import MalformedToolCall, parse_tool_calls
from grpo_stream.common.tools.functions import ToolSet, tool_from_function


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


class CalculatorEpisode:
    def __init__(self, tools: ToolSet, tool_format: str):
        self.tools, self.tool_format = tools, tool_format

    def step(self, turn_text: str) -> Turn:
        try:
            calls = parse_tool_calls(turn_text, self.tool_format)
        except MalformedToolCall:
            return Turn(Observation(result_text("error")))
        if not calls:
            return Turn(None)
        answer = self.tools.run(calls[0])
        return Turn(Observation(result_text("error" if answer.startswith("error") else answer)))


class ArithToolsEnvironment:
    def __init__(self, tool_format: str):
        self.tools = ToolSet([tool_from_function(add)])
        self.tool_format = tool_format
        assert TOOL_NAME in self.tools.names()

    def start(self, problem) -> CalculatorEpisode:
        return CalculatorEpisode(self.tools, self.tool_format)


def build(cfg, task, tokenizer) -> ArithToolsEnvironment:
    """The environment registry's entry (environment.name=arith_tools)."""
    del task, tokenizer
    return ArithToolsEnvironment(cfg.environment.tool_format)
