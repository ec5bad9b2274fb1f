"""Observations as tokens: rendered by the model's chat template, tokenized once, appended after the model's turn.

The model ended its turn by sampling a stop token (Qwen's <|im_end|>, Llama 3's <|eot_id|>, Gemma's
<end_of_turn>), which stays in the sequence as sampled. What follows it is what the chat template writes after an
assistant message's stop token, the observation's message, and the header of the next assistant turn: found as
the difference between the template's rendering of a conversation with and without the observation, around a
sentinel assistant message, so each family's own template decides (a tool message in Qwen's <tool_response>, Llama
3's ipython header, a user turn for Gemma, whose template has no tool role). The tiny CPU model has no chat
template: its observations are written as the environment phrases them (`PlainRenderer`).
"""

from __future__ import annotations

from grpo_stream.common.environments.base import Observation

_SENTINEL = "\u2063grpo-stream-sentinel-turn\u2063"


def well_formed(content: str) -> str:
    """`content` with each lone surrogate (U+D800-U+DFFF not in a pair) as U+FFFD, a pair written as two code points
    joined. A tool call's JSON may hold one (`"\\ud800"`, which Python's json reads) and an error that names the call
    echoes it; the tokenizer cannot encode it (TypeError), which ended the episode instead of answering it."""
    try:
        content.encode("utf-8")
    except UnicodeEncodeError:
        return content.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return content


class ChatTemplateRenderer:
    """Observation -> token ids by a Hugging Face tokenizer's chat template (model.kind=hf)."""

    def __init__(self, tokenizer):
        if not hasattr(tokenizer, "render_chat"):
            raise ValueError("environment: this tokenizer has no chat template; environments need one for an hf "
                             "model (or use the tiny model, whose observations are plain text)")
        self.tokenizer = tokenizer
        self._stop_texts = tokenizer.stop_texts()
        self._specials = sorted(tokenizer.special_texts(), key=len, reverse=True)
        self.text(Observation("0"))  # a template that cannot append observations fails here, not every episode

    def text(self, observation: Observation) -> str:
        """The text that follows the model's stop token: the template's end of the assistant turn, the observation
        message and the next assistant turn's header."""
        chat, before = self._sentinel_chat()
        after = self._rendered_after(chat, observation)
        # only what follows the sentinel matters: the earlier turns are the sampled ids, never rendered again (Qwen3
        # writes an empty think block into the last assistant message, and none once a tool message follows it)
        if _SENTINEL not in after:
            raise ValueError("environment: the chat template drops an assistant message once an observation follows; "
                             "observations cannot be appended token-exactly with it")
        stop, tail = self._turn_end(after)
        if stop != self._turn_end(before)[0]:
            raise ValueError("environment: the chat template ends an assistant turn with another stop token once an "
                             "observation follows; observations cannot be appended token-exactly with it")
        return tail[len(stop):]  # the stop token was sampled: it is already in the sequence

    def _rendered_after(self, chat: list[dict], observation: Observation) -> str:
        """The template's text of `chat` then the observation: its parts as messages of its role (several tool
        results, as the template writes a tool message per call), else its content as one message, else (a role the
        template refuses: Gemma has no tool role, nor a run of user turns) as one user message."""
        content = self.defused(well_formed(observation.content))
        attempts = [[{"role": observation.role, "content": content}]]
        if len(observation.parts) > 1:
            attempts.insert(0, [{"role": observation.role, "content": self.defused(well_formed(part))}
                                for part in observation.parts])
        if observation.role != "user":
            attempts.append([{"role": "user", "content": content}])
        for messages in attempts[:-1]:
            try:
                return self.tokenizer.render_chat(chat + messages, add_generation_prompt=True)
            except Exception:  # noqa: BLE001 - jinja raises for roles a template refuses (Gemma has no tool role)
                continue
        return self.tokenizer.render_chat(chat + attempts[-1], add_generation_prompt=True)

    def end_of_turn_ids(self) -> list[int]:
        """The ids of the stop token the template writes after an assistant message (Qwen's <|im_end|>, Llama 3's
        <|eot_id|>, Gemma's <end_of_turn>; not necessarily the tokenizer's first stop id: Llama 3.1 also stops on
        <|end_of_text|> and <|eom_id|>, Gemma on <eos>): what closes a turn cut at its budget before an
        observation. The tokenizer's first stop id where the template writes none of its stop tokens."""
        stop, _ = self._turn_end(self._sentinel_chat()[1])
        return self.tokenizer.encode(stop) if stop else [self.tokenizer.eos_ids[0]]

    def after_answer(self, closed: bool) -> str:
        """What the template writes after an assistant answer's sampled tokens: what follows its stop token when the
        model sampled one (`closed`), else the stop token too."""
        stop, tail = self._turn_end(self._sentinel_chat()[1])
        return tail[len(stop):] if closed else tail

    def _sentinel_chat(self) -> tuple[list[dict], str]:
        chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _SENTINEL}]
        return chat, self.tokenizer.render_chat(chat, add_generation_prompt=False)

    def _turn_end(self, before: str) -> tuple[str, str]:
        """(the stop token's text the template writes after the sentinel assistant message, or "" when it writes
        none; everything the template writes after that message)."""
        tail = before[before.index(_SENTINEL) + len(_SENTINEL):]
        return next((stop for stop in self._stop_texts if tail.startswith(stop)), ""), tail

    def render(self, observation: Observation) -> list[int]:
        return self.tokenizer.encode(self.text(observation))

    def defused(self, content: str) -> str:
        """`content` with every special token's text broken by a word joiner (U+2060), so a tool's output (code the
        model wrote printing `<|im_end|><|im_start|>assistant`) cannot become turn structure when tokenized."""
        for special in self._specials:
            if special in content:
                content = content.replace(special, special[0] + "\u2060" + special[1:])
        return content


class PlainRenderer:
    """Observation -> token ids for a tokenizer without a chat template (the tiny CPU model): its content as the
    environment wrote it, after a line break."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, observation: Observation) -> str:
        return " " + well_formed(observation.content)

    def end_of_turn_ids(self) -> list[int]:
        return [self.tokenizer.eos_ids[0]]

    def render(self, observation: Observation) -> list[int]:
        return self.tokenizer.encode(self.text(observation))


def renderer_for(tokenizer):
    """The chat template's renderer when the tokenizer has one, else plain text."""
    if getattr(tokenizer, "has_chat_template", False):
        return ChatTemplateRenderer(tokenizer)
    return PlainRenderer(tokenizer)
