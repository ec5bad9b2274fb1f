"""Tool calls per chat-template family: what render writes, parse reads back (one call and several); text without a
call is no call; a call marker whose call cannot be parsed is a MalformedToolCall whose message tells the model
what to write; the Python-style formats accept only literals, never evaluating anything."""


import pytest

from grpo_stream.common.tools.calls import (FAMILIES, MalformedToolCall, ToolCall, parse_tool_calls, render_tool_call,
                                            render_tool_calls)
from grpo_stream.common.tools.calculator import calculator
from grpo_stream.common.tools.functions import ToolSet

CALLS = [
    ToolCall("add", {"a": 1, "b": -2}),
    ToolCall("search", {"query": 'say "hi"\nand \'bye\' ``` </tool_call> </call> <',  # markers inside strings
                        "limit": 2.5, "exact": True, "note": None, "tags": ["x", 1, [2.0]],
                        "filters": {"k": {"n": False}}, "unicode": "π≈3.14"}),
    ToolCall("now", {}),
]
NO_CALL = ["The answer is 42.", "", "I would use a tool here, but 3 + 4 = 7 #### 7",
           'A JSON answer later in the text: {"name": "x", "parameters": {}}']


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.name)
def test_render_then_parse_is_the_same_call(family, call):
    text = render_tool_call(call, family)
    assert parse_tool_calls(text, family) == [call]
    # after prose: still the call, except in llama3, where only a turn that starts with the JSON calls
    assert parse_tool_calls(f"Let me check.\n{text}", family) == ([] if family == "llama3" else [call])


@pytest.mark.parametrize("family", FAMILIES)
def test_several_calls_in_one_turn(family):
    assert parse_tool_calls(render_tool_calls(CALLS, family), family) == CALLS


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("text", NO_CALL)
def test_text_without_a_call_is_no_call(family, text):
    assert parse_tool_calls(text, family) == []


def test_the_formats_as_models_write_them():
    assert parse_tool_calls('<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "qwen") == \
        [ToolCall("add", {"a": 1})]  # arguments as a JSON string
    assert parse_tool_calls("Thinking.<tool_call>{\"name\": \"now\"}</tool_call> and", "qwen") == [ToolCall("now")]
    assert parse_tool_calls('<|python_tag|>{"name": "add", "arguments": {"a": 1}}<|eom_id|>', "llama3") == \
        [ToolCall("add", {"a": 1})]
    assert parse_tool_calls('  {"name": "add", "parameters": {"a": 1}} ; {"name": "now", "parameters": {}};',
                            "llama3") == [ToolCall("add", {"a": 1}), ToolCall("now")]
    assert parse_tool_calls("```tool_code\nadd(a=1, b=2)\nnow()\n```", "gemma") == \
        [ToolCall("add", {"a": 1, "b": 2}), ToolCall("now")]
    assert parse_tool_calls(" <call>add(3, 4)</call>", "plain") == [ToolCall("add", {}, (3, 4))]
    assert parse_tool_calls("<call>add(3, b=(4, 5))</call> = 7", "plain") == [ToolCall("add", {"b": [4, 5]}, (3,))]


def test_plain_positional_arguments_reach_the_tool_in_parameter_order():
    def add(a: int, b: int) -> int:
        return a + b

    tools = ToolSet([add])
    assert tools.run(parse_tool_calls("<call>add(30, 12)</call>", "plain")[0]) == "42"
    assert tools.run(parse_tool_calls("<call>add(30, b=1)</call>", "plain")[0]) == "31"
    assert tools.run(parse_tool_calls("<call>add(1, 2, 3)</call>", "plain")[0]).startswith(
        "error: tool 'add' takes at most 2 positional arguments")


@pytest.mark.parametrize("family, text, message", [
    ("qwen", "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}\n", "error: <tool_call> is not closed by "
                                                                             "</tool_call>; write <tool_call>"),
    ("qwen", "<tool_call>{'name': 'add'}</tool_call>", "error: tool call is not valid JSON: Expecting property name"),
    ("qwen", "<tool_call>[1, 2]</tool_call>", "error: a tool call is a JSON object, got list"),
    ("qwen", '<tool_call>{"arguments": {}}</tool_call>', 'error: a tool call needs "name"'),
    ("qwen", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', 'error: "arguments" of the call of \'add\' '
                                                                         "must be a JSON object"),
    ("qwen", '<tool_call>{"name": "add", "arguments": "{a: 1}"}</tool_call>', 'error: "arguments" of the call of '
                                                                              "'add' is a string that is not a JSON"),
    ("llama3", '{"name": "add", "parameters": {"a": 1}', "error: tool call is not valid JSON"),
    ("llama3", '{"name": "add", "parameters": {}} and then I add them', "error: unexpected text after a tool call"),
    ("llama3", '{"answer": 42}', 'error: a tool call needs "name"'),
    ("llama3", "<|python_tag|>print(1 + 2)", "error: after <|python_tag|> write a JSON tool call"),
    ("gemma", "```tool_code\nadd(a=1\n```", "error: tool call is not valid Python call syntax"),
    ("gemma", "```tool_code\nadd(1, 2)\n```", "error: in this format tool arguments are named (like add(a=1))"),
    ("gemma", "```tool_code\nos.system(cmd='ls')\n```", "error: call the tool by its bare name"),
    ("gemma", "```tool_code\nadd(a=__import__('os').getpid())\n```", "error: argument 'a' of tool 'add' must be a "
                                                                       "Python literal"),
    ("gemma", "```tool_code\nadd(a=x)\n```", "error: argument 'a' of tool 'add' must be a Python literal"),
    ("gemma", "```tool_code\nadd(a={1, 2})\n```", "error: argument 'a' of tool 'add' must be a Python literal"),
    ("gemma", "```tool_code\nadd(**{'a': 1})\n```", "error: **arguments are not allowed"),
    ("gemma", "```tool_code\nresult = add(a=1)\n```", "error: a tool call is a single call of a tool by name"),
    ("gemma", "```tool_code\nadd(a=1)", "error: ```tool_code is not closed by ```"),
    ("gemma", "```tool_code\n\n```", "error: empty tool call"),
    ("plain", "<call>add(3, 4)", "error: <call> is not closed by </call>; write <call>tool_name(1, b=\"text\")"),
    ("plain", "<call>add(*[3, 4])</call>", "error: *arguments are not allowed"),
    ("plain", "<call>add(3, len('ab'))</call>", "error: positional argument 2 of tool 'add' must be a Python literal"),
    ("plain", "<call>import os</call>", "error: a tool call is a single call of a tool by name, got 'import os'"),
    ("plain", "<call>add(3, 4\x00)</call>", "error: tool call"),
    ("plain", "<call>add(" + "[" * 5000 + "]" * 5000 + ")</call>", "error: tool call"),
])
def test_a_malformed_call_says_what_to_write(family, text, message):
    with pytest.raises(MalformedToolCall) as raised:
        parse_tool_calls(text, family)
    assert raised.value.message.startswith(message), raised.value.message
    assert str(raised.value) == raised.value.message


def test_unknown_family_and_what_a_format_cannot_carry():
    with pytest.raises(ValueError, match=r"tool format 'hermes' is not one of \('qwen', 'llama3', 'gemma', 'plain'\)"):
        parse_tool_calls("<tool_call>{}</tool_call>", "hermes")
    with pytest.raises(ValueError, match="has no positional arguments; name them"):
        render_tool_call(ToolCall("add", {}, (1,)), "qwen")
    with pytest.raises(ValueError, match="is not a Python identifier"):
        render_tool_call(ToolCall("add-two", {}), "gemma")
    with pytest.raises(ValueError, match="argument name 'class' of add is not a Python identifier"):
        render_tool_call(ToolCall("add", {"class": 1}), "plain")
    with pytest.raises(ValueError, match="cannot be written as a tool argument"):
        render_tool_call(ToolCall("add", {"a": float("nan")}), "plain")
    assert render_tool_call(ToolCall("add", {"a": 1}, (2,)), "plain") == "<call>add(2, a=1)</call>"



@pytest.mark.parametrize("family", FAMILIES)
def test_arguments_too_deep_to_write_are_a_value_error_not_a_recursion_error(family):
    """render_tool_call (a client's assistant tool call written into a prompt) raised RecursionError for arguments
    nested past the recursion limit, which no caller's `except ValueError` caught."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ValueError, match="nested too deep"):
        render_tool_call(ToolCall("add", {"a": deep}), family)

@pytest.mark.parametrize("family", ["qwen", "llama3"])
@pytest.mark.parametrize("payload", ["9" * 5000, "[" * 100_000 + "]" * 100_000])
def test_json_too_large_or_too_deep_is_a_malformed_call_not_a_crash(family, payload):
    body = '{"name": "f", "arguments": {"x": ' + payload + '}}'
    text = f"<tool_call>\n{body}\n</tool_call>" if family == "qwen" else body
    with pytest.raises(MalformedToolCall) as caught:
        parse_tool_calls(text, family)
    assert caught.value.message.startswith("error:")


@pytest.mark.parametrize("family, text", [
    ("plain", "<call>add(" + "1+" * 400 + "1, 2)</call>"),  # parses; too deep for unparse's recursion
    ("plain", "<call>" + "1+" * 300 + "1</call>"),
    ("plain", "<call>add(0x" + "f" * 3600 + ", 1)</call>"),  # a literal of 4,300+ digits: Python will not write it
    ("gemma", "```tool_code\ncalculator(expression=0x" + "f" * 3600 + ")\n```"),
])
def test_python_style_calls_too_deep_to_show_or_too_long_to_write_are_malformed_not_a_crash(family, text):
    with pytest.raises(MalformedToolCall) as caught:
        parse_tool_calls(text, family)
    assert caught.value.message.startswith("error:")


@pytest.mark.parametrize("family, text", [
    ("qwen", '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>'),
    ("qwen", '<tool_call>{"name": "add", "arguments": {"a": [1, -Infinity]}}</tool_call>'),
    ("qwen", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1e999}"}</tool_call>'),  # arguments as a string
    ("llama3", '{"name": "add", "parameters": {"a": Infinity}}'),
    ("llama3", '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": -1e400}}'),
])
def test_json_calls_with_numbers_json_has_not_are_malformed(family, text):
    """Python's json reads NaN, Infinity and 1e999 (as inf): they reached the tools, and the endpoint answered
    `"arguments": "{\"a\": NaN}"`, which JSON clients cannot read. The Python-style formats already refused them."""
    with pytest.raises(MalformedToolCall) as caught:
        parse_tool_calls(text, family)
    assert caught.value.message.startswith("error: tool call JSON holds "), caught.value.message
    assert "which is not a finite number" in caught.value.message


@pytest.mark.parametrize("family", FAMILIES)
def test_no_format_writes_a_number_its_parser_refuses(family):
    with pytest.raises(ValueError, match="not finite"):
        render_tool_call(ToolCall("add", {"a": float("inf")}), family)


def test_a_qwen_call_may_name_its_arguments_parameters_and_they_reach_the_tool():
    """`{"name": "calculator", "parameters": {...}}` in a <tool_call> (llama3's key, which a model on the default
    format writes) was read as a call without arguments: the tool answered "needs argument 'expression'", an argument
    the model had given, so it could not tell what to change."""
    text = '<tool_call>\n{"name": "calculator", "parameters": {"expression": "17 * 3"}}\n</tool_call>'
    calls = parse_tool_calls(text, "qwen")
    assert calls == [ToolCall("calculator", {"expression": "17 * 3"})]
    assert ToolSet([calculator]).run(calls[0]) == "51"
    unclosed = '<tool_call>\n{"name": "calculator", "parameters": {"expression": "1 + 1"}}'
    assert parse_tool_calls(unclosed, "qwen") == [ToolCall("calculator", {"expression": "1 + 1"})]
