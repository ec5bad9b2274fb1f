"""Tool calls in a model turn's decoded text, per chat-template family (config environment.tool_format).

    qwen    Hermes / Qwen2.5 / Qwen3:  <tool_call>\\n{"name": "f", "arguments": {"a": 1}}\\n</tool_call>  (several
            allowed; "arguments" may also be a JSON string holding the object, "parameters" is accepted for it; a
            last <tool_call> left unclosed is a call when one whole JSON call follows it, as in vLLM's Hermes parser)
    llama3  Llama 3.1 / 3.2 JSON calling: the turn is {"name": "f", "parameters": {"a": 1}} ("arguments" accepted),
            optionally after <|python_tag|>; several separated by ';'. A turn not starting with '{' calls nothing.
    gemma   ```tool_code\\nf(a=1, b="x")\\n```: Python call syntax, keyword arguments only
    plain   <call>f(1, b=2)</call>: the tiny CPU model's; Python call syntax, positional arguments allowed (ToolSet.run
            maps them onto the tool's parameters in order)

The Python-style formats are parsed with `ast` and their values with `ast.literal_eval`: nothing is evaluated, and
anything but a bare tool name called with literal values (numbers, strings, True/False/None, lists, dicts) is
malformed. Numbers are finite in every format: NaN, Infinity or 1e999 in a JSON call is malformed (Python's json
would read them; JSON, and the endpoint's clients, have no such number). A text that contains a call marker but no
parseable call raises MalformedToolCall, whose message starts with "error:" and says what to write instead, so an
episode can hand it to the model as the observation.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import keyword
import math
import re
from typing import Any, Callable, Iterable, Mapping

FAMILIES = ("qwen", "llama3", "gemma", "plain")

_QWEN_OPEN, _QWEN_CLOSE = "<tool_call>", "</tool_call>"
_LLAMA_TAG, _LLAMA_END_TOKENS = "<|python_tag|>", ("<|eom_id|>", "<|eot_id|>")
_GEMMA_OPEN, _GEMMA_CLOSE = "```tool_code", "```"
_PLAIN_OPEN, _PLAIN_CLOSE = "<call>", "</call>"
_EXAMPLES = {
    "qwen": '<tool_call>\n{"name": "tool_name", "arguments": {"a": 1}}\n</tool_call>',
    "llama3": '{"name": "tool_name", "parameters": {"a": 1}}',
    "gemma": '```tool_code\ntool_name(a=1, b="text")\n```',
    "plain": '<call>tool_name(1, b="text")</call>',
}
# "parameters" too, as llama3 takes "arguments": a model on the default format (a bare ChatML template) that wrote
# it was answered "needs argument 'x'" for the argument it had given, and could not tell what to change
_QWEN_KEYS = ("arguments", "parameters")
_LITERALS = "a Python literal (a number, a string, True, False, None, or a list or dict of them)"
_SPACE, _LLAMA_TAIL = re.compile(r"\s*"), re.compile(r";*\s*")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name, its named arguments and (the 'plain' format only) its positional ones."""

    name: str
    arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    positional: tuple = ()


class MalformedToolCall(ValueError):
    """A turn that tries to call a tool but cannot be parsed. `message` (also str(exc)) starts with "error:" and
    is written for the model: what is wrong and what to write instead."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class _NonFinite(ValueError):
    """NaN, Infinity or a float past ±1.8e308 in a call's JSON: Python's json reads them, JSON has no such number."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NonFinite(text)
    return value


def _no_constant(text: str) -> float:
    raise _NonFinite(text)


_DECODER = json.JSONDecoder(parse_float=_finite_float, parse_constant=_no_constant)


def _non_finite(exc: _NonFinite, family: str) -> MalformedToolCall:
    return MalformedToolCall(f"error: tool call JSON holds {str(exc)[:40]}, which is not a finite number; JSON numbers "
                             f"are finite (like 1.5 or 2e10); write {_EXAMPLES[family]}")


def parse_tool_calls(text: str, family: str) -> list[ToolCall]:
    """The calls in a model turn, in order; [] when the turn calls no tool. Raises MalformedToolCall when the turn
    holds a call marker whose call cannot be parsed, ValueError for a family not in FAMILIES."""
    return _parser(family)(text)


def render_tool_call(call: ToolCall, family: str) -> str:
    """A call as the model writes it in `family`'s format (demonstrations, tests): parse(render(c)) == [c].
    Raises ValueError for what the format cannot carry (positional arguments outside 'plain', a name or keyword
    that is not a Python identifier in the Python-style formats, a non-finite float)."""
    _parser(family)  # checks the family
    if call.positional and family != "plain":
        raise ValueError(f"the {family!r} format has no positional arguments; name them (ToolCall.arguments)")
    # a closing marker inside a string would end the call early: the marker's first character is escaped there
    # (it can only occur inside string literals of the JSON or Python text)
    if family == "qwen":
        body = _json_text({"name": call.name, "arguments": dict(call.arguments)})
        body = body.replace("<", "\\u003c") if _QWEN_CLOSE in body else body
        return f"{_QWEN_OPEN}\n{body}\n{_QWEN_CLOSE}"
    if family == "llama3":
        return _json_text({"name": call.name, "parameters": dict(call.arguments)})
    text = _python_call_text(call)
    if family == "gemma":
        text = text.replace("`", "\\x60") if _GEMMA_CLOSE in text else text
        return f"{_GEMMA_OPEN}\n{text}\n{_GEMMA_CLOSE}"
    text = text.replace("<", "\\x3c") if _PLAIN_CLOSE in text else text
    return f"{_PLAIN_OPEN}{text}{_PLAIN_CLOSE}"


def render_tool_calls(calls: Iterable[ToolCall], family: str) -> str:
    """Several calls in one turn, separated as `family` separates them."""
    separator = {"qwen": "\n", "llama3": "; ", "gemma": "\n", "plain": " "}[family] if family in FAMILIES else ""
    return separator.join(render_tool_call(call, family) for call in calls)


def _parser(family: str) -> Callable[[str], list[ToolCall]]:
    parsers = {"qwen": _parse_qwen, "llama3": _parse_llama3, "gemma": _parse_gemma, "plain": _parse_plain}
    if family not in parsers:
        raise ValueError(f"tool format {family!r} is not one of {FAMILIES}; set environment.tool_format to one")
    return parsers[family]


def _parse_qwen(text: str) -> list[ToolCall]:
    bodies, unclosed = _between(text, _QWEN_OPEN, _QWEN_CLOSE, "qwen", last_may_be_unclosed=True)
    calls = [_json_call(body, _QWEN_KEYS, "qwen") for body in bodies]
    if unclosed is not None:
        # as vLLM's Hermes parser: a last <tool_call> left open (a client's stop=["</tool_call>"], a turn cut just
        # before it) is a call when all that follows it is one whole JSON call; anything else is the unclosed marker
        try:
            value = _json_value(unclosed, "qwen")
        except MalformedToolCall:
            raise _not_closed(_QWEN_OPEN, _QWEN_CLOSE, "qwen") from None
        calls.append(_call_from_object(value, _QWEN_KEYS, "qwen"))
    return calls


def _parse_llama3(text: str) -> list[ToolCall]:
    content = text.strip()
    for token in _LLAMA_END_TOKENS:  # present when the turn was decoded with its special tokens
        content = content.removesuffix(token).rstrip()
    tagged = content.startswith(_LLAMA_TAG)
    content = content.removeprefix(_LLAMA_TAG).lstrip()
    if not content.startswith("{"):
        if tagged:
            raise MalformedToolCall(f"error: after {_LLAMA_TAG} write a JSON tool call: {_EXAMPLES['llama3']}")
        return []
    calls, position = [], 0
    while True:
        try:
            value, position = _DECODER.raw_decode(content, position)
        except _NonFinite as exc:
            raise _non_finite(exc, "llama3") from None
        except json.JSONDecodeError as exc:
            raise MalformedToolCall(f"error: tool call is not valid JSON: {exc.msg} (character {exc.pos}); write "
                                    f"{_EXAMPLES['llama3']}") from None
        except (ValueError, RecursionError):  # an integer of over 4,300 digits, nesting past the recursion limit
            raise MalformedToolCall(f"error: tool call JSON is too large or too deep; write "
                                    f"{_EXAMPLES['llama3']}") from None
        calls.append(_call_from_object(value, ("parameters", "arguments"), "llama3"))
        # positions, not slices: slicing the rest after each call copied the turn's tail (quadratic in calls)
        position = _SPACE.match(content, position).end()
        if _LLAMA_TAIL.fullmatch(content, position):
            return calls
        if content[position] != ";":
            raise MalformedToolCall(f"error: unexpected text after a tool call: {content[position:position + 40]!r}; "
                                    "a turn that calls tools holds only the JSON calls, separated by ';'")
        position = _SPACE.match(content, position + 1).end()


def _parse_gemma(text: str) -> list[ToolCall]:
    return [call for body in _between(text, _GEMMA_OPEN, _GEMMA_CLOSE, "gemma")
            for call in _python_calls(body, positional_allowed=False, family="gemma")]


def _parse_plain(text: str) -> list[ToolCall]:
    return [call for body in _between(text, _PLAIN_OPEN, _PLAIN_CLOSE, "plain")
            for call in _python_calls(body, positional_allowed=True, family="plain")]


def _between(text: str, opening: str, closing: str, family: str, last_may_be_unclosed: bool = False):
    """The texts between each opening marker and the closing marker after it; with `last_may_be_unclosed`,
    (those texts, the text after a last opening marker left unclosed or None)."""
    bodies, position = [], 0
    while (start := text.find(opening, position)) != -1:
        end = text.find(closing, start + len(opening))
        if end == -1:
            if last_may_be_unclosed:
                return bodies, text[start + len(opening):]
            raise _not_closed(opening, closing, family)
        bodies.append(text[start + len(opening):end])
        position = end + len(closing)
    return (bodies, None) if last_may_be_unclosed else bodies


def _not_closed(opening: str, closing: str, family: str) -> MalformedToolCall:
    return MalformedToolCall(f"error: {opening} is not closed by {closing}; write {_EXAMPLES[family]}")


def _json_call(body: str, argument_keys: tuple[str, ...], family: str) -> ToolCall:
    return _call_from_object(_json_value(body, family), argument_keys, family)


def _json_value(body: str, family: str) -> Any:
    """The one JSON value `body` holds (whitespace around it allowed), or MalformedToolCall saying what is wrong."""
    try:
        return _DECODER.decode(body)
    except _NonFinite as exc:
        raise _non_finite(exc, family) from None
    except json.JSONDecodeError as exc:
        raise MalformedToolCall(f"error: tool call is not valid JSON: {exc.msg} (line {exc.lineno}, column "
                                f"{exc.colno}); write {_EXAMPLES[family]}") from None
    except (ValueError, RecursionError):  # an integer of over 4,300 digits, nesting past the recursion limit
        raise MalformedToolCall(f"error: tool call JSON is too large or too deep; write {_EXAMPLES[family]}") from None


def _call_from_object(value: Any, argument_keys: tuple[str, ...], family: str) -> ToolCall:
    example = _EXAMPLES[family]
    if not isinstance(value, dict):
        raise MalformedToolCall(f"error: a tool call is a JSON object, got {type(value).__name__}; write {example}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise MalformedToolCall(f'error: a tool call needs "name", the tool\'s name as a string; write {example}')
    key = next((k for k in argument_keys if k in value), argument_keys[0])
    arguments = value.get(key)
    if arguments is None:  # a call of a tool without parameters may leave its arguments out
        arguments = {}
    if isinstance(arguments, str):  # some templates and models write the arguments object as a JSON string
        try:
            arguments = _DECODER.decode(arguments) if arguments.strip() else {}
        except _NonFinite as exc:
            raise _non_finite(exc, family) from None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, or too large / too deep
            raise MalformedToolCall(f'error: "{key}" of the call of {name!r} is a string that is not a JSON '
                                    f"object: {getattr(exc, 'msg', 'too large or too deep')}; write {example}") from None
    if not isinstance(arguments, dict):
        raise MalformedToolCall(f'error: "{key}" of the call of {name!r} must be a JSON object of name: value, '
                                f"got {type(arguments).__name__}; write {example}")
    return ToolCall(name, arguments)


def _python_calls(source: str, positional_allowed: bool, family: str) -> list[ToolCall]:
    example = _EXAMPLES[family]
    try:
        tree = ast.parse(source.strip(), mode="exec")
    except SyntaxError as exc:
        raise MalformedToolCall(f"error: tool call is not valid Python call syntax: {exc.msg}; write "
                                f"{example}") from None
    except (ValueError, RecursionError, MemoryError):  # null bytes; nesting deeper than the parser takes
        raise MalformedToolCall(f"error: tool call could not be parsed; write {example}") from None
    if not tree.body:
        raise MalformedToolCall(f"error: empty tool call; write {example}")
    return [_python_call(statement, positional_allowed, family) for statement in tree.body]


def _python_call(statement: ast.stmt, positional_allowed: bool, family: str) -> ToolCall:
    example = _EXAMPLES[family]
    call = statement.value if isinstance(statement, ast.Expr) else None
    if not isinstance(call, ast.Call):
        raise MalformedToolCall(f"error: a tool call is a single call of a tool by name, got "
                                f"{_shown(statement)}; write {example}")
    if not isinstance(call.func, ast.Name):
        raise MalformedToolCall(f"error: call the tool by its bare name (like tool_name(...)), not "
                                f"{_shown(call.func)}; write {example}")
    name = call.func.id
    if call.args and not positional_allowed:
        raise MalformedToolCall(f"error: in this format tool arguments are named (like {name}(a=1)); "
                                f"write {example}")
    positional = []
    for node in call.args:
        if isinstance(node, ast.Starred):
            raise MalformedToolCall(f"error: *arguments are not allowed in a tool call; write {example}")
        positional.append(_literal(node, f"positional argument {len(positional) + 1}", name))
    arguments = {}
    for item in call.keywords:
        if item.arg is None:
            raise MalformedToolCall(f"error: **arguments are not allowed in a tool call; write {example}")
        arguments[item.arg] = _literal(item.value, f"argument '{item.arg}'", name)
    return ToolCall(name, arguments, tuple(positional))


def _literal(node: ast.expr, what: str, tool: str) -> Any:
    """The value of a literal expression, JSON-like (tuples become lists); anything else is malformed."""
    try:
        return _json_like(ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise MalformedToolCall(f"error: {what} of tool '{tool}' must be {_LITERALS}; got {_shown(node)}") from None


def _shown(node: ast.AST) -> str:
    """The start of what the model wrote, for an error text; a tree too deep to write back says so instead (the
    parser takes deeper nesting than unparse's recursion)."""
    try:
        return repr(ast.unparse(node)[:60])
    except (RecursionError, MemoryError, ValueError):
        return "an expression nested too deep to show"


MAX_INT_BITS = 10_000  # about 3,000 digits: below the 4,300 digits Python still writes as text


def _json_like(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TypeError(f"an integer of {value.bit_length()} bits, over {MAX_INT_BITS}")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError("not finite")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_like(item) for item in value]
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return {key: _json_like(item) for key, item in value.items()}
    raise TypeError(type(value).__name__)  # set, bytes, complex, dict with non-string keys


def _python_call_text(call: ToolCall) -> str:
    if not call.name.isidentifier() or keyword.iskeyword(call.name):
        raise ValueError(f"tool name {call.name!r} is not a Python identifier; the Python-style formats need one")
    parts = [_python_literal(value) for value in call.positional]
    for key, value in call.arguments.items():
        if not key.isidentifier() or keyword.iskeyword(key):
            raise ValueError(f"argument name {key!r} of {call.name} is not a Python identifier; the Python-style "
                             "formats need one")
        parts.append(f"{key}={_python_literal(value)}")
    return f"{call.name}({', '.join(parts)})"


def _json_text(value: dict) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except ValueError:  # NaN or an infinity: what the parser refuses (JSON has no such number)
        raise ValueError(f"{value!r} cannot be written as a tool call (a float that is not finite); use finite "
                         "numbers") from None
    except RecursionError:  # a client's arguments nested past the recursion limit: said as such, not a crash
        raise ValueError("a tool call's arguments are nested too deep to be written; nest them less") from None


def _python_literal(value: Any) -> str:
    try:
        return repr(_json_like(value))
    except TypeError as exc:
        raise ValueError(f"{value!r} cannot be written as a tool argument ({exc}); use JSON-like values") from None
    except RecursionError:  # as _json_text's
        raise ValueError("a tool argument is nested too deep to be written; nest it less") from None
