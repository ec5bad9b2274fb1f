"""Tools for any chat template: what a template writes of tools and tool calls, the rest written in the tool format's
own style, and the tool format inferred from the template when environment.tool_format is unset (issue 58).

Many small instruct models ship a bare ChatML template (SmolLM2's): it renders every role the same way and ignores
the `tools` argument and an assistant message's `tool_calls`. A prompt rendered with tools then lists none, the
OpenAI endpoint's `tools=[...]` never reaches the model, and a demonstrated call renders as an empty assistant turn,
all silently. So at start-up `probe` renders a conversation with and without tools, and an assistant message with
and without a tool call, and compares; what the template leaves out, `for_template` writes into the messages before
the template renders them:

- the tool schemas at the end of the system turn (a system turn is put first when the conversation has none, or,
  for a template that refuses a system role, they open the first user turn), with an example call in the format;
- each assistant message's calls at the end of its content (Llama 3's format: instead of it, since its parser reads
  a call only from a turn that starts with one, and Llama's own template writes the call alone), written by
  calls.py's `render_tool_calls`: what the format's parser reads back, so a call the model samples and a call
  demonstrated in a conversation look the same.

A template that writes both is left alone: the same text as before, byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

from grpo_stream.common.tools.calls import FAMILIES, ToolCall, render_tool_call, render_tool_calls

# the format for a template whose family is not known and that writes no tool markup of its own (a bare ChatML one):
# Hermes-style <tool_call> JSON, the format most open instruct models were tuned on, with JSON arguments as in
# OpenAI's API and markers that a parser finds in free text
DEFAULT_FORMAT = "qwen"
_NOTES = {
    "qwen": "Several calls: one <tool_call> block each.",
    "llama3": "A message that calls a tool holds only the call; several calls are separated by ';'.",
    "gemma": "Several calls: one per line in the block.",
    "plain": "Several calls: one <call> tag each.",
}
_PROBE_NAME, _PROBE_VALUE = "probe_tool_q7x", "probe-value-k3z"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_NAME, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"probe_arg": {"type": "string"}}, "required": ["probe_arg"]}}}
Render = Callable[[list[dict], bool, "list[dict] | None"], str]


@dataclasses.dataclass(frozen=True)
class ToolSupport:
    """What a chat template writes itself: the `tools` argument's schemas, an assistant message's `tool_calls`, a
    system turn."""

    schemas: bool = True
    calls: bool = True
    system: bool = True

    @property
    def complete(self) -> bool:
        return self.schemas and self.calls

    def missing(self) -> str:
        """What the template leaves out, in words ('' when nothing)."""
        return " and ".join(what for what, writes in (("tool schemas (tools=)", self.schemas),
                                                      ("assistant tool calls (tool_calls)", self.calls)) if not writes)


def probe(render: Render) -> ToolSupport:
    """What the template behind `render(messages, add_generation_prompt, tools) -> text` writes, by comparing its
    renderings of a probe conversation with and without tools, and with and without an assistant's tool call (a
    template writes the call when the call's argument appears in its text only with it). A rendering the template
    refuses (raises) counts as not written."""
    system = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    has_system = _renders(lambda: render(system, True, None)) is not None
    start = system if has_system else system[1:]
    with_tools = _renders(lambda: render(start, True, [_PROBE_TOOL]))
    without = _renders(lambda: render(start, True, None)) or ""
    schemas = with_tools is not None and _PROBE_NAME in with_tools and _PROBE_NAME not in without
    call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME,
                                                                 "arguments": {"probe_arg": _PROBE_VALUE}}}
    answer = {"role": "assistant", "content": ""}
    called = start + [dict(answer, tool_calls=[call])]
    with_call = _renders(lambda: render(called, False, [_PROBE_TOOL])) or _renders(lambda: render(called, False, None))
    without_call = _renders(lambda: render(start + [answer], False, [_PROBE_TOOL])) or ""
    calls = with_call is not None and _PROBE_VALUE in with_call and _PROBE_VALUE not in without_call
    return ToolSupport(schemas, calls, has_system)


def _renders(render: Callable[[], str]) -> str | None:
    try:
        return render()
    except Exception:  # noqa: BLE001 - jinja raises whatever the template raises (TemplateError, TypeError, ...)
        return None


def infer_tool_format(template: str | None, model_type: str | None) -> tuple[str, str]:
    """(format, why) for environment.tool_format unset: by the tool markup the chat template writes, else the model's
    family (config.json model_type), else DEFAULT_FORMAT; 'plain' without a chat template (the tiny model)."""
    if not template:
        return "plain", "the tokenizer has no chat template (the tiny model's format)"
    markers = (("qwen", ("<tool_call>",)), ("llama3", ("<|python_tag|>", "ipython", "<|start_header_id|>")),
               ("gemma", ("<start_of_turn>",)))
    for family, marks in markers:
        found = next((mark for mark in marks if mark in template), None)
        if found:
            return family, f"its chat template writes {found}"
    family = (model_type or "").lower()
    for prefix in ("qwen", "gemma"):
        if family.startswith(prefix):
            return prefix, f"config.json model_type is {model_type}"
    return DEFAULT_FORMAT, ("its chat template writes no tool markup of a known family: the default, Hermes-style "
                            "<tool_call> JSON")


def tools_text(tools: list[dict], family: str) -> str:
    """The tool schemas and how to call them, in `family`'s format, for a template that does not write them."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    example = render_tool_call(ToolCall("tool_name", {"argument": "value"}), family)
    return (f"You can call these tools, described by their JSON schemas:\n<tools>\n{listed}\n</tools>\n\n"
            f"To call a tool, write:\n{example}\n{_NOTES[family]} Each tool's result comes back to you in the next "
            "message.")


def for_template(messages: list[dict[str, Any]], tools: list[dict] | None, family: str,
                 support: ToolSupport) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools) to hand a template with `support`: as given where it writes both itself; else the schemas
    (then not passed as tools) and the calls written into the messages in `family`'s format."""
    if support.complete or family not in FAMILIES:
        return messages, tools
    out = [m if support.calls or not m.get("tool_calls") else _with_calls_written(m, family) for m in messages]
    if tools and not support.schemas:
        out, tools = _with_schemas_written(out, tools_text(tools, family), support.system), None
    return out, tools


def _with_schemas_written(messages: list[dict], text: str, system: bool) -> list[dict]:
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [dict(first, content=f"{first.get('content') or ''}\n\n{text}".lstrip("\n")), *messages[1:]]
    if system:
        return [{"role": "system", "content": text}, *messages]
    at = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if at is None:  # no system role and no user turn: the tools go first, as a user turn (the only place left)
        return [{"role": "user", "content": text}, *messages]
    user = messages[at]
    return [*messages[:at], dict(user, content=f"{text}\n\n{user.get('content') or ''}"), *messages[at + 1:]]


def _with_calls_written(message: dict, family: str) -> dict:
    """An assistant message with its tool_calls written at the end of its content (Llama 3: as its content)."""
    calls = [_tool_call(call, family) for call in message["tool_calls"]]
    try:
        written = render_tool_calls(calls, family)
    except ValueError as exc:
        raise ValueError(f"an assistant message's tool call cannot be written in the {family!r} tool format: "
                         f"{exc}") from None
    content, separator = message.get("content") or "", " " if family == "plain" else "\n"
    if content and family != "llama3":
        written = content + separator + written
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": written}


def _tool_call(call: dict, family: str) -> ToolCall:
    """A template-style tool call ({"function": {"name", "arguments"}}, arguments an object or a JSON text) as a
    ToolCall; 'plain' positional arguments travel as "_positional" (the endpoint's answers write them so)."""
    fn = call.get("function", call) if isinstance(call, dict) else {}
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("a tool call needs function.name and function.arguments")
    arguments = fn.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise ValueError(f"the arguments of the call of {fn['name']!r} are not JSON") from None
        except RecursionError:  # a client's JSON nested past the recursion limit: refused, naming the call
            raise ValueError(f"the arguments of the call of {fn['name']!r} are JSON nested too deep") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of the call of {fn['name']!r} are not an object")
    arguments = dict(arguments)
    positional = arguments.pop("_positional", []) if family == "plain" else []
    if not isinstance(positional, list):  # 5 raised TypeError, "ab" became two arguments 'a' and 'b'
        raise ValueError(f'"_positional" of the call of {fn["name"]!r} must be a list of its positional arguments, '
                         f"got {type(positional).__name__}")
    return ToolCall(fn["name"], arguments, tuple(positional))
