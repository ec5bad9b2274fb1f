"""Plain Python functions as tools: a JSON schema from the signature and docstring, calls checked against it.

`tool_from_function(fn)` reads the type hints (int, float, str, bool, list[X], dict[str, X], Literal[...],
X | None), the defaults (a parameter with one is optional) and a Google-style docstring (the first paragraph
describes the tool, the `Args:` section each parameter). `Tool.call(arguments)` is what an episode runs on a
parsed call: it never raises, because whatever goes wrong (an argument the model invented, a wrong type, the
function failing) is something the model should read and correct, so it comes back as text starting "error:"
that names the argument and what was expected. Nothing is evaluated: arguments are data, checked by type.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import types
import typing
from typing import Any, Callable, Iterable, Literal, Mapping, Protocol, Sequence

_SCALAR_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}
_EXPECTED = {"boolean": "true or false", "integer": "an integer", "number": "a number", "string": "a string",
             "array": "an array", "object": "an object", "null": "null"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")  # also a Python identifier: the python-style formats need one
_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^(\s*)\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_HINTS = "int, float, str, bool, list[...], dict[str, ...], Literal[...] or X | None"


class CallLike(Protocol):
    """What ToolSet.run needs of a parsed call (calls.ToolCall)."""

    name: str
    arguments: Mapping[str, Any]
    positional: tuple


class _Rejected(Exception):
    """An argument that does not fit the schema; the message is the model's observation."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call. `parameters` is the JSON schema of its arguments (an object schema)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Callable[..., Any]

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates render into the prompt."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": json.loads(json.dumps(self.parameters))}}

    def parameter_names(self) -> list[str]:
        """The parameters in the function's order (positional arguments are mapped onto it)."""
        return list(self.parameters["properties"])

    def call(self, arguments: Mapping[str, Any], positional: Sequence[Any] = ()) -> str:
        """Runs the function on checked arguments and returns its result as text (str, or JSON for a dict, list
        or tuple). Never raises an Exception (nor SystemExit): a bad argument or a failing function gives an
        "error: ..." text."""
        try:
            kwargs = self._checked(self._merged(arguments, positional))
        except _Rejected as exc:
            return str(exc)
        try:
            result = self.function(**kwargs)
            # written inside the guard too: a result Python cannot write (an integer of 5,000 digits) is a failure
            return json.dumps(result, default=str) if isinstance(result, (dict, list, tuple)) else str(result)
        # SystemExit too: model-written code calling exit() in an in-process tool is the call's failure, not the
        # worker's (it escaped the episode and left its group in flight for ever)
        except (Exception, SystemExit) as exc:  # the function's failure is an observation, not the episode's end
            return f"error: tool '{self.name}' failed: {type(exc).__name__}: {str(exc)[:200]}"

    def _merged(self, arguments: Mapping[str, Any], positional: Sequence[Any]) -> dict:
        if not isinstance(arguments, Mapping):
            raise _Rejected(f"error: the arguments of tool '{self.name}' must be an object of name: value, got "
                            f"{_describe(arguments)}")
        names = self.parameter_names()
        if len(positional) > len(names):
            raise _Rejected(f"error: tool '{self.name}' takes at most {len(names)} positional arguments "
                            f"({', '.join(names) or 'none'}), got {len(positional)}")
        merged = dict(zip(names, positional))
        for key, value in arguments.items():
            if key in merged:
                raise _Rejected(f"error: argument '{key}' of tool '{self.name}' is given both by position and by "
                                "name; give it once")
            merged[key] = value
        return merged

    def _checked(self, arguments: dict) -> dict:
        properties, required = self.parameters["properties"], self.parameters.get("required", [])
        for key in arguments:
            if key not in properties:
                raise _Rejected(f"error: tool '{self.name}' has no argument '{key}'; its arguments: "
                                f"{self._signature_text()}")
        for key in required:
            if key not in arguments:
                raise _Rejected(f"error: tool '{self.name}' needs argument '{key}' ({_expected(properties[key])}); "
                                f"its arguments: {self._signature_text()}")
        return {key: _conform(value, properties[key], key, self.name) for key, value in arguments.items()}

    def _signature_text(self) -> str:
        properties, required = self.parameters["properties"], self.parameters.get("required", [])
        parts = [f"{key} ({_expected(schema)}{'' if key in required else ', optional'})"
                 for key, schema in properties.items()]
        return ", ".join(parts) or "none"


class ToolSet:
    """The tools an episode offers, by name. Plain functions are turned into tools with tool_from_function."""

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = ()):
        by_name: dict[str, Tool] = {}
        for item in tools:
            tool = item if isinstance(item, Tool) else tool_from_function(item)
            if tool.name in by_name:
                raise ValueError(f"two tools are named '{tool.name}'; give one another name "
                                 "(tool_from_function(fn, name=...))")
            by_name[tool.name] = tool
        self.tools: Mapping[str, Tool] = types.MappingProxyType(by_name)

    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict]:
        """Every tool's function schema, for the chat template's `tools` argument."""
        return [tool.schema() for tool in self.tools.values()]

    def run(self, call: CallLike) -> str:
        """The observation for one parsed call: the tool's text result or an "error: ..." text. Never raises."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool '{call.name}'; tools: {self.names()}"
        return tool.call(call.arguments, getattr(call, "positional", ()))


def tool_from_function(fn: Callable[..., Any], name: str | None = None, description: str | None = None) -> Tool:
    """A Tool from a function with type hints on every parameter. `name` defaults to the function's name,
    `description` to its docstring's first paragraph. Raises TypeError naming the parameter whose hint or kind
    cannot be described in JSON schema, ValueError for a name chat formats cannot carry."""
    tool_name = name or getattr(fn, "__name__", "")
    if not _NAME.match(tool_name):
        raise ValueError(f"tool name {tool_name!r} must be a Python identifier of at most 64 characters (letters, "
                         "digits, underscores); pass name=... to tool_from_function")
    summary, argument_docs = parse_docstring(inspect.getdoc(fn) or "")
    hints = typing.get_type_hints(fn)
    properties: dict[str, dict] = {}
    required: list[str] = []
    for parameter in inspect.signature(fn).parameters.values():
        where = f"parameter '{parameter.name}' of {tool_name}"
        if parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
            raise TypeError(f"{where}: *args, **kwargs and positional-only parameters cannot be tool arguments; "
                            "use named parameters")
        if parameter.name not in hints:
            raise TypeError(f"{where} has no type hint; annotate it with {_HINTS}")
        schema = _schema_of(hints[parameter.name], where)
        if parameter.name in argument_docs:
            schema["description"] = argument_docs[parameter.name]
        if parameter.default is parameter.empty:
            required.append(parameter.name)
        elif _is_json(parameter.default):
            schema["default"] = parameter.default
        properties[parameter.name] = schema
    parameters = {"type": "object", "properties": properties, "required": required}
    return Tool(tool_name, summary if description is None else description, parameters, fn)


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(the first paragraph as one line, {parameter: description} from a Google-style `Args:` section)."""
    lines = inspect.cleandoc(doc).splitlines()
    summary: list[str] = []
    for line in lines:
        if not line.strip() or _SECTION.match(line):
            break
        summary.append(line.strip())
    arguments: dict[str, str] = {}
    section_indent, entry_indent, current = None, None, None
    for line in lines:
        header = _SECTION.match(line)
        if header:
            section_indent, entry_indent, current = len(header.group(1)), None, None
            continue
        if section_indent is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= section_indent:  # the next section (Returns:, Raises:) or prose: Args ended
            section_indent = None
            continue
        entry = _ARG_LINE.match(line)
        if entry and (entry_indent is None or indent <= entry_indent):
            entry_indent, current = indent, entry.group(2)
            arguments[current] = entry.group(3).strip()
        elif current is not None:  # a continuation line of the current entry
            arguments[current] = f"{arguments[current]} {line.strip()}".strip()
    return " ".join(summary), arguments


def _schema_of(hint: Any, where: str) -> dict:
    if hint in _SCALAR_TYPES:
        return {"type": _SCALAR_TYPES[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is list or origin is list:
        return {"type": "array", "items": _schema_of(args[0], where)} if args else {"type": "array"}
    if hint is dict or origin is dict:
        if not args:
            return {"type": "object"}
        if args[0] is not str:
            raise TypeError(f"{where}: JSON object keys are strings; use dict[str, ...]")
        return {"type": "object", "additionalProperties": _schema_of(args[1], where)}
    if origin is Literal:
        return _literal_schema(args, where)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = _schema_of(next(a for a in args if a is not type(None)), where)
        inner["type"] = [inner["type"], "null"]
        if "enum" in inner:
            inner["enum"] = [*inner["enum"], None]
        return inner
    raise TypeError(f"{where}: type {hint!r} is not supported; use {_HINTS}")


def _literal_schema(values: tuple, where: str) -> dict:
    kinds = {_SCALAR_TYPES.get(type(value)) for value in values}
    if len(kinds) != 1 or None in kinds or "number" in kinds:
        raise TypeError(f"{where}: Literal values must all be strings, all integers or all booleans, got {values!r}")
    return {"type": kinds.pop(), "enum": list(values)}


def _conform(value: Any, schema: Mapping[str, Any], where: str, tool: str) -> Any:
    """The value as the function should receive it (int for an integral number where an integer is expected, float
    for an int where a number is), or _Rejected naming the argument and what it should be."""
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if value is None and "null" in kinds:
        return None
    for kind in kinds:
        fitted = _fit(value, kind, schema, where, tool)
        if fitted is not _NO_FIT:
            if "enum" in schema and fitted not in schema["enum"]:
                raise _Rejected(f"error: argument '{where}' of tool '{tool}' must be one of {schema['enum']}, got "
                                f"{_describe(value)}")
            return fitted
    raise _Rejected(f"error: argument '{where}' of tool '{tool}' must be {_expected(schema)}, got {_describe(value)}")


_NO_FIT = object()


def _fit(value: Any, kind: str, schema: Mapping[str, Any], where: str, tool: str) -> Any:
    if isinstance(value, bool):  # JSON true is not a number, though Python's bool is an int
        return value if kind == "boolean" else _NO_FIT
    if kind == "integer":
        if isinstance(value, int):
            return value
        return int(value) if isinstance(value, float) and value.is_integer() else _NO_FIT
    if kind == "number":
        if not isinstance(value, (int, float)):
            return _NO_FIT
        try:
            return float(value)
        except OverflowError:  # an integer past float's range (the formats take 3,000 digits): Tool.call never raises
            raise _Rejected(f"error: argument '{where}' of tool '{tool}' must be a number within about "
                            f"±1.8e308, got an integer of {value.bit_length()} bits") from None
    if kind == "string":
        return value if isinstance(value, str) else _NO_FIT
    if kind == "array" and isinstance(value, (list, tuple)):
        items = schema.get("items")
        return [_conform(v, items, f"{where}[{i}]", tool) if items else v for i, v in enumerate(value)]
    if kind == "object" and isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        values = schema.get("additionalProperties")
        return {k: _conform(v, values, f"{where}.{k}", tool) if values else v for k, v in value.items()}
    return _NO_FIT


def _expected(schema: Mapping[str, Any]) -> str:
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    words = []
    for kind in kinds:
        word = _EXPECTED.get(kind, kind)
        if kind == "array" and isinstance(schema.get("items"), Mapping):
            word = f"an array whose items are each {_expected(schema['items'])}"
        words.append(word)
    text = " or ".join(words) or "any value"
    return f"{text}, one of {schema['enum']}" if "enum" in schema else text


def _describe(value: Any) -> str:
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}.get(type(value))
    if kind is None:
        kind = "array" if isinstance(value, (list, tuple)) else "object" if isinstance(value, Mapping) else \
            type(value).__name__
    try:
        text = json.dumps(value, default=repr) if kind != "null" else "null"
    except (ValueError, RecursionError):  # an integer too long to write, a structure too deep
        text = "(too large to show)"
    return text if kind == "null" else f"{kind} {text[:60]}{'...' if len(text) > 60 else ''}"


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
