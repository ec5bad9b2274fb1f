"""The multi-turn CPU demo's environment: addition problems with a calculator tool (`add`).

A model turn that calls the tool (`<call>add(a, b)</call>`, the 'plain' tool format) is answered with the sum
(` = c`); a malformed call with ` = error`; a turn without a call ends the episode, and the run's rewards score that
final turn (its `#### N`, read as a single-turn completion's: the first that holds a number; earlier turns' guesses
are not the answer, common/episodes/groups.py). The tiny model's tokenizer is trained on this text (common/tasks/arith_tools.py).
"""

from __future__ import annotations

from grpo_stream.common.environments.tool_episode import ToolEpisode, TurnLimits, run_tool_format
from grpo_stream.common.tasks.arith_tools import TOOL_NAME, result_text
from grpo_stream.common.tools.functions import ToolSet, tool_from_function


def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


def phrase_first(answers: list[str]) -> str:
    """The demo's observation: the first call's sum, or ` = error` (the tiny tokenizer knows no other words)."""
    return result_text("error" if answers[0].startswith("error") else answers[0])


class ArithToolsEnvironment:
    def __init__(self, tool_format: str, limits: TurnLimits = TurnLimits()):
        self.tools = ToolSet([tool_from_function(add)])
        self.tool_format, self.limits = tool_format, limits
        assert TOOL_NAME in self.tools.names()

    def start(self, problem) -> ToolEpisode:
        return ToolEpisode(self.tools, self.tool_format, phrase_first, self.limits)


def build(cfg, task, tokenizer) -> ArithToolsEnvironment:
    """The environment registry's entry (environment.name=arith_tools)."""
    del task
    return ArithToolsEnvironment(run_tool_format(cfg, tokenizer), TurnLimits.of(cfg))
