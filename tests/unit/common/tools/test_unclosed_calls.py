"""A Qwen/Hermes call whose last <tool_call> is left open: a call when one whole JSON call follows the marker, as
vLLM's Hermes parser reads it (a client's stop=["</tool_call>"] cuts the closing marker off the text; a turn cut at
its budget just before it), in a tool episode and in the OpenAI endpoint's answer alike; else still malformed."""

import json

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.endpoint.app import endpoint_core
from grpo_stream.common.engine.side_requests import SideQueue
from grpo_stream.common.environments.gsm8k_tools import environment_for
from grpo_stream.common.model.tokenizer import HFTokenizer
from grpo_stream.common.tools.calculator import math_tools
from grpo_stream.common.tools.calls import MalformedToolCall, ToolCall, parse_tool_calls
from grpo_stream.common.tools.python_sandbox import SandboxLimits
from tests.chat_families import build_tokenizer

CALL = '{"name": "calculator", "arguments": {"expression": "17 * 3"}}'
CALCULATE = ToolCall("calculator", {"expression": "17 * 3"})


@pytest.mark.parametrize("text, calls", [
    (f"<tool_call>\n{CALL}\n", [CALCULATE]),
    (f"Let me compute.\n<tool_call>\n{CALL}", [CALCULATE]),
    (f'<tool_call>\n{{"name": "now"}}\n</tool_call>\n<tool_call>\n{CALL}\n', [ToolCall("now"), CALCULATE]),
])
def test_a_whole_json_call_after_an_unclosed_last_marker_is_a_call(text, calls):
    assert parse_tool_calls(text, "qwen") == calls


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17',   # cut inside the JSON
    f"<tool_call>\n{CALL}\nand then I will add 3",                         # text after the call
    "I would write a <tool_call> tag here",
])
def test_anything_else_after_an_unclosed_marker_is_still_malformed(text):
    with pytest.raises(MalformedToolCall, match="^error: <tool_call> is not closed by </tool_call>"):
        parse_tool_calls(text, "qwen")


def test_a_whole_but_wrong_call_after_an_unclosed_marker_says_what_is_wrong():
    with pytest.raises(MalformedToolCall, match='^error: a tool call needs "name"'):
        parse_tool_calls('<tool_call>\n{"arguments": {}}', "qwen")


def test_a_tool_episode_runs_an_unclosed_last_call():
    episode = environment_for(load_config(None, ["environment.tool_format=qwen"])).start(None)
    assert episode.step(f"<tool_call>\n{CALL}\n").observation.content == "51"


def test_the_endpoint_answers_an_unclosed_last_call_as_tool_calls(tmp_path):
    """The endpoint returned the text as content and no tool_calls (finish_reason stop) where vLLM returns the call:
    a client stopping at </tool_call> never got its tool called."""
    tokenizer = HFTokenizer(build_tokenizer(tmp_path / "qwen", "qwen", "qwen2"))
    core = endpoint_core(load_config(None, ["sampler.openai.port=0"]), None, SideQueue(8), tokenizer)
    assert core.tool_format == "qwen"
    message, called = core._message(f"Let me compute.\n<tool_call>\n{CALL}\n", math_tools(SandboxLimits()).schemas())
    assert called and message["content"] == "Let me compute."
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "17 * 3"}
