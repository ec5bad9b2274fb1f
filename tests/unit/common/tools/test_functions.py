"""Functions as tools: the JSON schema read from type hints, defaults and docstrings; calls checked against it, with
every failure an "error:" text naming the argument; a ToolSet's dispatch, positional arguments included."""

import json
from typing import Literal, Optional

import pytest

from grpo_stream.common.tools.calls import ToolCall
from grpo_stream.common.tools.functions import ToolSet, parse_docstring, tool_from_function


def search(query: str, limit: int = 5, scale: float = 1.0, exact: bool = False,
           mode: Literal["fast", "full"] = "fast", tags: list[str] | None = None,
           weights: dict[str, float] | None = None, note: Optional[str] = None) -> dict:
    """Search the notes
    for a query.

    Args:
        query (str): what to look for;
            may span lines.
        limit: how many results.
        mode: how hard to look.

    Returns:
        the matches (not an argument).
    """
    return {"query": query, "limit": limit, "scale": scale, "exact": exact, "mode": mode, "tags": tags,
            "weights": weights, "note": note}


def add(a: int, b: int) -> int:
    """Add two whole numbers."""
    return a + b


def test_schema_from_signature_and_docstring():
    schema = tool_from_function(search).schema()
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "search"
    assert function["description"] == "Search the notes for a query."
    parameters = function["parameters"]
    assert parameters["type"] == "object" and parameters["required"] == ["query"]
    properties = parameters["properties"]
    assert list(properties) == ["query", "limit", "scale", "exact", "mode", "tags", "weights", "note"]
    assert properties["query"] == {"type": "string", "description": "what to look for; may span lines."}
    assert properties["limit"] == {"type": "integer", "description": "how many results.", "default": 5}
    assert properties["scale"] == {"type": "number", "default": 1.0}
    assert properties["exact"] == {"type": "boolean", "default": False}
    assert properties["mode"] == {"type": "string", "enum": ["fast", "full"], "description": "how hard to look.",
                                  "default": "fast"}
    assert properties["tags"] == {"type": ["array", "null"], "items": {"type": "string"}, "default": None}
    assert properties["weights"] == {"type": ["object", "null"], "additionalProperties": {"type": "number"},
                                     "default": None}
    assert properties["note"] == {"type": ["string", "null"], "default": None}
    json.dumps(schema)  # plain JSON all the way down


def test_docstring_sections():
    summary, arguments = parse_docstring("""Only a summary line.

    More prose that is not the summary.

    Arguments:
        x: the x.
        y (list[int]): the y,
            continued here.
    Raises:
        ValueError: not an argument.
    """)
    assert summary == "Only a summary line."
    assert arguments == {"x": "the x.", "y": "the y, continued here."}
    assert parse_docstring("") == ("", {})


def test_name_and_description_overrides_and_bad_definitions():
    tool = tool_from_function(add, name="plus", description="Adds.")
    assert (tool.name, tool.description) == ("plus", "Adds.")

    def untyped(a, b: int):
        return a

    def star(*values: int):
        return values

    def union(a: int | str):
        return a

    def float_keys(a: dict[int, int]):
        return a

    with pytest.raises(TypeError, match="parameter 'a' of untyped has no type hint"):
        tool_from_function(untyped)
    with pytest.raises(TypeError, match=r"parameter 'values' of star: \*args"):
        tool_from_function(star)
    with pytest.raises(TypeError, match="parameter 'a' of union: type .* is not supported; use int, float"):
        tool_from_function(union)
    with pytest.raises(TypeError, match=r"dict\[str, \.\.\.\]"):
        tool_from_function(float_keys)
    with pytest.raises(ValueError, match="must be a Python identifier"):
        tool_from_function(lambda x: x)
    with pytest.raises(ValueError, match="must be a Python identifier"):
        tool_from_function(add, name="add-two")


def test_a_valid_call_returns_text_and_json():
    tool = tool_from_function(search)
    assert tool.call({"query": "q"}) == json.dumps(search("q"))
    assert tool_from_function(add).call({"a": 2, "b": 3}) == "5"
    result = json.loads(tool.call({"query": "q", "limit": 2.0, "scale": 3, "tags": ["a"], "weights": {"w": 1},
                                   "note": None}))
    assert result["limit"] == 2 and isinstance(result["limit"], int)  # an integral number is an integer
    assert result["scale"] == 3.0 and result["weights"] == {"w": 1.0}  # an int is accepted for a float


@pytest.mark.parametrize("arguments, expected", [
    ({"query": "q", "colour": 1}, "error: tool 'search' has no argument 'colour'; its arguments: query (a string), "
                                  "limit (an integer, optional)"),
    ({"limit": 3}, "error: tool 'search' needs argument 'query' (a string)"),
    ({"query": 3}, "error: argument 'query' of tool 'search' must be a string, got integer 3"),
    ({"query": "q", "limit": True}, "error: argument 'limit' of tool 'search' must be an integer, got boolean true"),
    ({"query": "q", "limit": 2.5}, "error: argument 'limit' of tool 'search' must be an integer, got number 2.5"),
    ({"query": "q", "scale": "big"}, "error: argument 'scale' of tool 'search' must be a number, got string"),
    ({"query": "q", "mode": "slow"}, "error: argument 'mode' of tool 'search' must be one of ['fast', 'full'], got "
                                     'string "slow"'),
    ({"query": "q", "tags": ["a", 2]}, "error: argument 'tags[1]' of tool 'search' must be a string, got integer"),
    ({"query": "q", "tags": "a"}, "error: argument 'tags' of tool 'search' must be an array whose items are each a "
                                  "string or null, got string"),
    ({"query": None}, "error: argument 'query' of tool 'search' must be a string, got null"),
    ({"query": "q", "weights": {"w": "x"}}, "error: argument 'weights.w' of tool 'search' must be a number"),
    (["q"], "error: the arguments of tool 'search' must be an object of name: value, got array"),
])
def test_a_bad_call_is_an_error_text_naming_the_argument(arguments, expected):
    assert tool_from_function(search).call(arguments).startswith(expected)


def test_a_failing_function_is_an_error_text_and_nothing_is_evaluated():
    def divide(a: int, b: int) -> float:
        return a / b

    assert tool_from_function(divide).call({"a": 1, "b": 0}) == \
        "error: tool 'divide' failed: ZeroDivisionError: division by zero"
    code = "__import__('os').system('touch /tmp/never')"
    assert tool_from_function(search).call({"query": code}) == json.dumps(search(code))



def test_a_function_that_exits_is_an_error_text_not_a_raise():
    """An in-process tool running model-written code that calls exit() raised SystemExit, which is no Exception: it
    escaped the episode's worker and left the episode (and its group) in flight for ever."""
    def run(code: str) -> str:
        exec(code, {})  # noqa: S102 - what a naive in-process tool does with the model's code
        return "ran"

    assert tool_from_function(run).call({"code": "exit(3)"}) == "error: tool 'run' failed: SystemExit: 3"

def test_toolset_dispatch_and_positional_arguments():
    tools = ToolSet([add, tool_from_function(search)])
    assert tools.names() == ["add", "search"] and set(tools.tools) == {"add", "search"}
    assert [s["function"]["name"] for s in tools.schemas()] == ["add", "search"]
    assert tools.run(ToolCall("add", {"a": 1, "b": 2})) == "3"
    assert tools.run(ToolCall("add", {"b": 2}, (5,))) == "7"
    assert tools.run(ToolCall("add", {}, (5, 6))) == "11"
    assert tools.run(ToolCall("add", {}, (1, 2, 3))) == \
        "error: tool 'add' takes at most 2 positional arguments (a, b), got 3"
    assert tools.run(ToolCall("add", {"a": 1}, (1,))).startswith(
        "error: argument 'a' of tool 'add' is given both by position and by name")
    assert tools.run(ToolCall("add", {}, ("x", 1))).startswith("error: argument 'a' of tool 'add' must be an integer")
    assert tools.run(ToolCall("mul", {"a": 1})) == "error: unknown tool 'mul'; tools: ['add', 'search']"
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        ToolSet([add, add])


def test_a_result_or_argument_python_cannot_write_is_an_error_text_not_a_raise():
    def power(base: int, exponent: int) -> int:
        """Args:
            base: the base.
            exponent: the exponent."""
        return base ** exponent

    tool = tool_from_function(power)
    assert tool.call({"base": 10, "exponent": 5000}).startswith("error: tool 'power' failed: ValueError")
    assert tool.call({"base": "x" * 10, "exponent": 2}).startswith("error:")
    assert tool.call({"base": 16 ** 3600, "exponent": 1}).startswith("error:")  # described, not written out


@pytest.mark.parametrize("text, family", [
    ("<call>search('q', scale=" + "9" * 400 + ")</call>", "plain"),
    ('<tool_call>{"name": "search", "arguments": {"query": "q", "weights": {"w": 1' + "0" * 400 + "}}}</tool_call>",
     "qwen"),
])
def test_an_integer_past_a_floats_range_for_a_number_is_an_error_text_not_a_raise(text, family):
    """A number argument given as an integer of 400 digits (both formats read it) raised OverflowError out of
    Tool.call, which never raises: the episode ended with the error instead of the model reading what is wrong."""
    from grpo_stream.common.tools.calls import parse_tool_calls

    [call] = parse_tool_calls(text, family)
    answer = ToolSet([tool_from_function(search)]).run(call)
    assert answer.startswith("error: argument '") and "must be a number within about ±1.8e308" in answer
