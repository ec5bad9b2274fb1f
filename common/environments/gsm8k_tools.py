"""GSM8K with tools: a calculator and a sandboxed Python tool, called in the model family's format.

Each model turn is searched for tool calls in the run's tool format (environment.tool_format, or the one inferred from
the model's chat template; qwen, llama3, gemma; common/tools/calls.py).
Calls are run and their results are the observation (one result per line, in call order); a malformed call is
answered with an error that says what is wrong, so the model can correct itself; a turn without a call ends the
episode and the run's rewards score that final model turn (`#### N` or the task's answer format; what earlier turns
state, a guess before a tool answered or code that prints `#### 75`, is not the answer: common/episodes/groups.py). The prompt lists the
tools through the chat template's `tools=` (task.prompt_template=tools), or in the system turn for a template that
does not write them (common/tools/template_tools.py).
"""

from __future__ import annotations

from grpo_stream.common.environments.tool_episode import ToolEpisode, TurnLimits, run_tool_format
from grpo_stream.common.tools.calculator import math_tools, sandbox_limits
from grpo_stream.common.tools.python_sandbox import SandboxLimits


class Gsm8kToolsEnvironment:
    def __init__(self, tool_format: str, limits: SandboxLimits, turn: TurnLimits = TurnLimits()):
        self.tools = math_tools(limits)
        self.tool_format, self.turn = tool_format, turn

    def start(self, problem) -> ToolEpisode:
        return ToolEpisode(self.tools, self.tool_format, limits=self.turn)


def environment_for(cfg, tokenizer=None) -> Gsm8kToolsEnvironment:
    return Gsm8kToolsEnvironment(run_tool_format(cfg, tokenizer), sandbox_limits(cfg), TurnLimits.of(cfg))


def build(cfg, task, tokenizer) -> Gsm8kToolsEnvironment:
    """The environment registry's entry (environment.name=gsm8k_tools)."""
    del task
    return environment_for(cfg, tokenizer)
