"""The GSM8K tools environment: its calculator (common/tools/calculator.py), and episodes that call tools in each
family's format."""

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.environments.arith_tools import ArithToolsEnvironment
from grpo_stream.common.environments.gsm8k_tools import environment_for
from grpo_stream.common.tools.calculator import calculator
from grpo_stream.common.tools.calls import ToolCall, render_tool_call
from grpo_stream.common.tools.python_sandbox import confinement_problem


@pytest.mark.parametrize("expression, expected", [("(48 + 12) * 3 / 4", "45"), ("7 // 2", "3"), ("2 ** 10", "1024"),
                                                  ("-3 + 0.5", "-2.5"), ("10 / 4", "2.5"),
                                                  ("1 / 3e12", "3.33333333333e-13"), ("0.1 + 0.2", "0.3")])
def test_the_calculator_computes(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('id')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("9 ** 9 ** 9", "exponent"), ("(((3**64)**64)**64)**64", "bits"), ("(10 ** 60) ** 64", "bits"), ("1 / 0", "division by zero"), ("1 +", "error:"), ("1" * 600, "longer than"),
    ("(-8) ** 0.5", "not a real number"), ("1e308 * 10", "too large")])
def test_the_calculator_refuses_anything_but_arithmetic(expression, message):
    answer = calculator(expression)
    assert answer.startswith("error:") and message in answer


def _environment(family):
    cfg = load_config(None, [f"environment.tool_format={family}"])
    return environment_for(cfg)


@pytest.mark.parametrize("family", ["qwen", "llama3", "gemma"])
def test_an_episode_runs_the_calls_of_its_family_and_ends_without_one(family):
    episode = _environment(family).start(None)
    call = render_tool_call(ToolCall("calculator", {"expression": "17 * 3"}), family)
    turn = episode.step(f"I will compute it.\n{call}" if family != "llama3" else call)
    assert turn.observation.content == "51" and turn.observation.role == "tool"
    assert episode.step("So the answer is\n#### 51").observation is None


@pytest.mark.parametrize("family, text", [("qwen", '<tool_call>\n{"name": "calculator", "arguments": \n</tool_call>'),
                                          ("gemma", "```tool_code\ncalculator(expression=open('x'))\n```")])
def test_a_malformed_call_is_answered_with_what_is_wrong(family, text):
    turn = _environment(family).start(None).step(text)
    assert turn.observation.content.startswith("error:")


def test_an_unknown_tool_and_bad_arguments_are_answered_not_raised():
    episode = _environment("qwen").start(None)
    bad = [ToolCall("search", {"q": "x"}), ToolCall("calculator", {"expr": "1"})]
    turn = episode.step("\n".join(render_tool_call(c, "qwen") for c in bad))
    first, second = turn.observation.content.split("\n", 1)
    assert first.startswith("error: unknown tool") and second.startswith("error:") and "expression" in second


@pytest.mark.skipif(confinement_problem() is not None, reason="no Landlock/seccomp here: the Python tool refuses")
def test_the_python_tool_runs_in_its_sandbox():
    episode = _environment("qwen").start(None)
    code = "import math\nprint(math.comb(10, 3))"
    turn = episode.step(render_tool_call(ToolCall("python", {"code": code}), "qwen"))
    assert turn.observation.content.strip() == "120"
    leak = episode.step(render_tool_call(ToolCall("python", {"code": "print(open('/etc/hostname').read())"}),
                                         "qwen"))
    assert leak.observation.content.startswith("error:")


def test_the_demo_environment_answers_calls_and_errors():
    episode = ArithToolsEnvironment("plain").start(None)
    assert episode.step(" <call>add(37, 48)</call>").observation.content == "= 85"
    assert episode.step(" <call>add(37 48)</call>").observation.content == "= error"
    assert episode.step(" <call>mul(3, 4)</call>").observation.content == "= error"
    assert episode.step(" #### 85").observation is None


@pytest.mark.skipif(confinement_problem() is not None, reason=f"cannot confine: {confinement_problem()}")
def test_a_turn_runs_at_most_its_calls_within_its_tool_time():
    """A turn of 12 sandboxed calls that each sleep to their wall limit would hold a worker 12 x that limit: it runs
    environment.max_calls_per_turn calls at most, and none once environment.turn_tool_seconds is spent."""
    cfg = load_config(None, ["environment.tool_format=qwen", "environment.max_calls_per_turn=5",
                             "environment.turn_tool_seconds=2.5", "environment.python_tool.wall_seconds=1"])
    episode = environment_for(cfg).start(None)
    sleeper = render_tool_call(ToolCall("python", {"code": "import time\ntime.sleep(5)"}), "qwen")
    answers = episode.step("\n".join([sleeper] * 12)).observation.content.splitlines()
    ran = [a for a in answers if a.startswith("error: timed out after 1 s")]
    spent = [a for a in answers if "environment.turn_tool_seconds" in a]
    capped = [a for a in answers if "environment.max_calls_per_turn" in a]
    # 5 at most, of which the calls started within 2.5 s ran (each takes its 1 s and a start: 3 on an idle machine)
    assert len(capped) == 7 and len(ran) + len(spent) == 5 and 1 <= len(ran) <= 3 and len(spent) >= 2, answers
