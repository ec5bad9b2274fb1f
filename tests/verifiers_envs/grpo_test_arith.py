"""`verifiers` environments for the adapter's tests, written with the package's own classes as an environment author
writes them: `load_environment(kind=...)` returns

- 'single': a SingleTurnEnv over addition questions with a Rubric of two weighted functions (the answer inside
  <answer></answer>, and brevity);
- 'tools': a ToolEnv with a calculator tool (a Python function) and the same rubric. A model that calls no tool is
  asked once more to use it (a user message), so every episode of an untrained model has two model turns and an
  observation between them; a model that calls it gets the tool's answer.

Loaded by module name (`task.verifiers.environment=grpo-test-arith`) from this directory on PYTHONPATH.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

QUESTIONS = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in
             ((12, 30), (7, 8), (21, 5), (40, 2), (3, 9), (18, 11), (25, 25), (6, 14))]
PARSER = vf.XMLParser(["answer"], answer_field="answer")


def correct_answer(completion, answer, **kwargs) -> float:
    return 1.0 if (PARSER.parse_answer(completion) or "").strip() == answer else 0.0


def brevity(completion, **kwargs) -> float:
    return 1.0 if completion and len(completion[-1].content or "") < 40 else 0.0


def calculator(expression: str) -> str:
    """Evaluate a sum of whole numbers.

    Args:
        expression: Numbers joined by '+', such as "2+2".
    """
    parts = expression.replace(" ", "").split("+")
    if not all(p.isdigit() for p in parts):
        return "error: write whole numbers joined by '+'"
    return str(sum(int(p) for p in parts))


class NudgedToolEnv(vf.ToolEnv):
    """The calculator environment; a first answer without a tool call gets one user reminder."""

    @vf.stop
    async def no_tools_called(self, state: vf.State) -> bool:
        return len(state["trajectory"]) >= 2 and await super().no_tools_called(state)

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        if not getattr(messages[-1], "tool_calls", None):
            return [vf.UserMessage(role="user", content="Use the calculator, then answer.")]
        return await super().env_response(messages, state, **kwargs)


def load_environment(kind: str = "single") -> vf.Environment:
    rubric = vf.Rubric(funcs=[correct_answer, brevity], weights=[1.0, 0.25], parser=PARSER)
    data = Dataset.from_list(QUESTIONS)
    if kind == "single":
        return vf.SingleTurnEnv(dataset=data, system_prompt="Answer inside <answer></answer>.", parser=PARSER,
                                rubric=rubric)
    if kind == "tools":
        return NudgedToolEnv(dataset=data, tools=[calculator], max_turns=3, parser=PARSER, rubric=rubric,
                             system_prompt="Use the calculator, then answer inside <answer></answer>.")
    raise ValueError(f"kind={kind!r}: 'single' or 'tools'")
