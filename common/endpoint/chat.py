"""Chat messages -> prompt token ids for the OpenAI-compatible endpoint, token-exact across the turns of a
conversation.

A chat client (an agent loop, a `verifiers` environment) sends the whole conversation each turn, the model's
earlier answers as text. Rendering and tokenizing that text again can give other ids than the ones the model
sampled (a merge across the turn boundary, a normalised space), and a trainer scoring those would score tokens the
policy never drew. So the endpoint remembers each answer it gave, keyed by the conversation up to and including that
answer as the client will send it back (`ChatPrompts.remember`): when a request continues a remembered conversation,
its prompt is the remembered ids (prompt and sampled answer, exactly) followed by the rest of the conversation
rendered by the model's chat template the way common/environments/render.py renders an observation (what the
template writes after an assistant message's stop token, the new messages, the next assistant header). A request
that continues no remembered conversation, or whose template renders earlier turns differently once later ones
follow, is rendered whole (counted in `rendered_whole`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from typing import Any

import numpy as np

from grpo_stream.common.environments.render import ChatTemplateRenderer
from grpo_stream.common.model import chat_messages
from grpo_stream.common.endpoint.protocol import RequestError

REMEMBERED_BYTES = 64 << 20  # memory of remembered conversations in all, oldest dropped first
ENTRY_BYTES = 400  # one remembered entry beside its ids and key (dict node, tuple, array header): 282 B measured


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as Hugging Face chat templates take them (common/model/chat_messages.py); a message they
    cannot take is the request's error, naming the field."""
    try:
        return chat_messages.template_messages(messages)
    except chat_messages.MessageError as exc:
        raise RequestError(str(exc)) from None


def conversation_key(messages: list[dict[str, Any]], tools: list[dict] | None, caller: str) -> str:
    """A digest of one caller's conversation as the template sees it, with the ids of its tool calls (unique to
    each answer the endpoint gave, so two answers calling the same tool are told apart)."""
    canonical = [{"role": m["role"], "content": m["content"],
                  "tool_calls": [{"id": c.get("id", ""), **c["function"]} for c in m.get("tool_calls", [])]}
                 for m in messages]
    blob = json.dumps([caller, canonical, tools or []], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


class ChatPrompts:
    """Prompt ids for chat requests, reusing the exact ids of remembered conversations. Thread-safe. Each caller
    (token name) continues only its own conversations: a caller cannot make another's prompt start with ids the
    visible text does not show. Answers the same caller got twice with the same text but other ids (n > 1) are
    ambiguous: such a conversation is rendered whole, and its entry (no ids) is counted and evicted like the others.
    What is held is bounded in bytes (`max_bytes`: ids, keys and each entry's own cost). Tools and tool calls the
    template does not write itself are written in `tool_format` (the endpoint's; HFTokenizer.render_chat)."""

    def __init__(self, tokenizer, max_bytes: int = REMEMBERED_BYTES, tool_format: str | None = None):
        self.renderer = ChatTemplateRenderer(tokenizer) if getattr(tokenizer, "has_chat_template", False) else None
        self.tokenizer, self.max_bytes, self.tool_format = tokenizer, max_bytes, tool_format
        self._remembered: collections.OrderedDict[str, tuple[np.ndarray, bool] | None] = collections.OrderedDict()
        self._bytes = 0  # held, by _cost
        self._lock = threading.Lock()
        self.continued = self.rendered_whole = 0

    def defused(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tool results with special-token text broken (render.py's `defused`): a tool's output cannot become turn
        structure in the prompt, nor in the episodes a run trains on."""
        if self.renderer is None:
            return messages
        return [dict(m, content=self.renderer.defused(m["content"])) if m["role"] == "tool" else m for m in messages]

    def ids(self, messages: list[dict[str, Any]], tools: list[dict] | None, caller: str = "") -> list[int]:
        """The prompt of a chat request (template_messages form) ending in the assistant header."""
        if self.renderer is None:
            raise RequestError("messages: this model's tokenizer has no chat template (the tiny CPU model); use "
                               "/v1/completions with a text prompt")
        cut = next((c for c in range(len(messages) - 1, 0, -1) if messages[c - 1]["role"] == "assistant"), None)
        if cut is not None:  # only the last assistant answer can be continued from
            key = conversation_key(messages[:cut], tools, caller)
            with self._lock:
                found = self._remembered.get(key)
                if found is not None:
                    self._remembered.move_to_end(key)
            tail = self._continuation(messages, cut, tools, closed=found[1]) if found is not None else None
            if tail is not None:
                self.continued += 1
                return found[0].tolist() + self.tokenizer.encode(tail)
        self.rendered_whole += 1
        return self.tokenizer.encode(self._render(messages, True, tools))

    def _render(self, messages, add_generation_prompt: bool, tools) -> str:
        """The template's text; what it refuses (roles out of order) is the request's error. A template without a
        tool role (Gemma's) gets tools' results as user messages, as environments' observations are written
        (common/environments/render.py), so a conversation that called a tool can go on."""
        def render(chat):
            return self.tokenizer.render_chat(chat, add_generation_prompt=add_generation_prompt, tools=tools,
                                              tool_format=self.tool_format)
        try:
            return render(messages)
        except Exception as exc:  # noqa: BLE001 - jinja raises what the template raises (TemplateError, TypeError...)
            refused = exc
        if any(m["role"] == "tool" for m in messages):
            try:
                return render([{"role": "user", "content": m["content"]} if m["role"] == "tool" else m
                               for m in messages])
            except Exception:  # noqa: BLE001 - refused either way: the first refusal is the one to report
                pass
        raise RequestError(f"messages: this model's chat template refused them ({type(refused).__name__}: "
                           f"{str(refused)[:200]})") from None

    def _continuation(self, messages, cut: int, tools, closed: bool) -> str | None:
        """What follows the remembered answer's last sampled token, or None when the template renders the earlier
        turns differently once the new messages follow."""
        before = self._render(messages[:cut], False, tools)
        after = self._render(messages, True, tools)
        if not after.startswith(before):
            return None
        return self.renderer.after_answer(closed) + after[len(before):]

    def remember(self, messages: list[dict[str, Any]], answer: dict[str, Any], tools: list[dict] | None,
                 ids: list[int], closed: bool, caller: str = "") -> None:
        """Conversation `messages` + the assistant `answer` (as returned to the client) has exactly `ids`; `closed`:
        the answer ended with a stop token (else the template's end of turn is written before what follows). The
        oldest conversations are forgotten beyond `max_bytes` in all."""
        key = conversation_key(messages + template_messages([answer]), tools, caller)
        held = np.asarray(ids, np.int32)
        with self._lock:
            if key in self._remembered:  # the same visible answer twice: ambiguous unless the ids agree
                earlier = self._remembered.pop(key)
                self._bytes -= _cost(key, earlier)
                same = earlier is not None and earlier[1] == closed and np.array_equal(earlier[0], held)
                self._remembered[key] = (held, closed) if same else None
            else:
                self._remembered[key] = (held, closed)
            self._bytes += _cost(key, self._remembered[key])
            while self._bytes > self.max_bytes and self._remembered:
                dropped_key, dropped = self._remembered.popitem(last=False)
                self._bytes -= _cost(dropped_key, dropped)

    @property
    def held_bytes(self) -> int:
        return self._bytes


def _cost(key: str, entry: tuple[np.ndarray, bool] | None) -> int:
    """What one remembered entry holds: its ids, its key and the entry itself (an ambiguous one: no ids)."""
    return ENTRY_BYTES + len(key) + (0 if entry is None else entry[0].nbytes)
