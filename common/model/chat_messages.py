"""OpenAI chat messages as Hugging Face chat templates take them, for every path that renders them: the endpoint's
requests (common/endpoint/chat.py) and a verifiers environment's dataset prompts (common/tasks/verifiers_task.py).
One function, so the text a verifiers problem's first turn is rendered as is the text the endpoint renders when the
environment sends the same messages (a template given OpenAI's text parts concatenates a list to a string and
fails)."""

from __future__ import annotations

import json
from typing import Any


class MessageError(ValueError):
    """A message a chat template cannot take; names the field (`where`[i].field) and what it must be."""


def template_messages(messages: list[dict[str, Any]], where: str = "messages") -> list[dict[str, Any]]:
    """`messages` with text parts joined, 'developer' as 'system', tool-call arguments as objects (the templates
    write them with `tojson`), and `name` and `tool_call_id` kept. `where`: how errors name the list."""
    if not isinstance(messages, list):  # a dataset row's prompt as plain text would be iterated per character
        raise MessageError(f"{where}: a list of messages, each an object with a role and content, not "
                           f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise MessageError(f"{where}[{i}].role: each message is an object with a role (system, user, assistant, "
                               "tool) and content")
        message = {"role": "system" if m["role"] == "developer" else m["role"],
                   "content": _text(m.get("content"), f"{where}[{i}]")}
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise MessageError(f"{where}[{i}].tool_calls: a list of calls, each with function.name and "
                                   "function.arguments")
            message["tool_calls"] = [_template_call(call, f"{where}[{i}]") for call in m["tool_calls"]]
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                message[key] = m[key]
        out.append(message)
    return out


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        for i, part in enumerate(content):  # an object or a number as text rendered as its Python repr
            if not isinstance(part.get("text", ""), str):
                raise MessageError(f"{where}.content[{i}].text: a string, not {type(part['text']).__name__}")
        return "".join(p.get("text", "") for p in content)
    raise MessageError(f"{where}.content: a string or a list of text parts (this policy reads text only)")


def _template_call(call: dict, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise MessageError(f"{where}.tool_calls: each needs function.name and function.arguments")
    arguments = fn.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise MessageError(f"{where}.tool_calls: function.arguments is not JSON") from None
        except RecursionError:
            raise MessageError(f"{where}.tool_calls: function.arguments nests too deep") from None
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}
