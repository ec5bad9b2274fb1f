"""The OpenAI-compatible endpoint's requests and answers: what is accepted, how a request becomes token ids and
engine sequences, and how finished sequences become `chat.completion` / `text_completion` objects.

What the endpoint serves is the live policy as the sampler samples it, so a request may ask for what the engine
does and nothing else; anything else is refused with a 400 that names the field (never silently ignored):
- temperature: omitted or generation.temperature (the engine's; its logprobs are the policy's at that temperature,
  the behaviour logprobs the trainer uses), or 0 for greedy. top_p: omitted or 1. No penalties, logit_bias, echo,
  suffix or best_of. `stream: true` is answered as server-sent events once the choices are done (streaming.py).
- logprobs: the sampled token's logprob (chat: `logprobs: true`, `top_logprobs` 0; completions: `logprobs` 0).
- seed: sequence i of a request with seed s samples with key fold_in(key(s), i), as the engine's own `generate`
  samples row i of a batch with key(s): the same tokens and logprobs.
vLLM's RL extensions are answered as vLLM answers them: with `return_token_ids: true`, `prompt_token_ids` (at the
top of a chat completion, per choice of a text completion) and each choice's `token_ids`, so a caller never
re-tokenizes text. A text completion's `prompt` may be token ids (a list of ints, or a list of such lists).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

# OpenAI's API takes 4, vLLM's any number: lm-eval sends a task's `until` and the EOS text (aime: 5, humaneval and
# gsm8k-cot-llama: 6), so 4 refused them; each is one substring search of a finished answer
MAX_STOPS = 32
ROLLOUT_FIELD = "grpo_rollout"  # an internal request's extra field: the rollout group its model call belongs to
# fields that would change the sampling: served only left out, null, or at the values that change nothing, as vLLM
# reads them (clients send vLLM's neutral set, repetition_penalty 1, top_k 0, min_p 0, which was refused)
_SAMPLING = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "top_k": (0, -1),
             "min_p": (0,), "logit_bias": ({},), "suffix": ("",), "guided_json": (), "guided_regex": (),
             "response_format": ({"type": "text"},)}
# vLLM's sampling extensions: served only at the value that changes nothing
_NEUTRAL = (("ignore_eos", False), ("min_tokens", 0), ("stop_token_ids", []), ("include_stop_str_in_output", False),
            ("skip_special_tokens", True), ("prompt_logprobs", None), ("chat_template_kwargs", {}),
            ("continue_final_message", False), ("add_generation_prompt", True), ("spaces_between_special_tokens", True))
# the undeclared fields the endpoint reads; any other is dropped as it is validated: a client's megabytes of `user` or
# `metadata` (or a message's unknown keys) were held, as 20-30 times their size in Python objects, while it waited
READ_EXTRAS = frozenset((*_SAMPLING, *(name for name, _ in _NEUTRAL), ROLLOUT_FIELD,
                         "return_tokens_as_token_ids"))
# fields OpenAI's API takes null for, meaning their default (the openai SDK sends null for an argument passed as None)
_NULL_IS_DEFAULT = ("n", "stream", "return_token_ids", "logprobs", "echo", "add_special_tokens")
_MESSAGE_KEYS, _PART_KEYS, _CALL_KEYS = ("role", "content", "tool_calls", "name", "tool_call_id"), ("type", "text"), (
    "id", "type", "function")


class RequestError(ValueError):
    """A request the endpoint cannot serve: answered 400 with this message (it names the field and the fix)."""


class UnknownModel(RequestError):
    """A request naming a model this endpoint does not serve: answered 404, as OpenAI and vLLM answer it (the openai
    SDK raises NotFoundError)."""


def _shown(value: Any) -> str:
    """`value` as an error message shows it: its repr, cut (a refused field may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _only(item: Any, keys: tuple[str, ...]) -> Any:
    return {k: item[k] for k in keys if k in item} if isinstance(item, dict) else item


def _message_kept(message: Any) -> Any:
    """A message with only what the templates read (common/model/chat_messages.py); what is malformed is kept as it
    is, for template_messages to name."""
    kept = _only(message, _MESSAGE_KEYS)
    if isinstance(kept, dict) and isinstance(kept.get("content"), list):
        kept["content"] = [_only(part, _PART_KEYS) for part in kept["content"]]
    if isinstance(kept, dict) and isinstance(kept.get("tool_calls"), list):
        kept["tool_calls"] = [_only(call, _CALL_KEYS) for call in kept["tool_calls"]]
        for call in kept["tool_calls"]:
            if isinstance(call, dict) and "function" in call:
                call["function"] = _only(call["function"], ("name", "arguments"))
    return kept


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False  # a last chunk with the usage and no choices (OpenAI's)


class _Common(BaseModel):
    # OpenAI clients send fields this endpoint never needs (user, metadata, store...): ignored unless they would
    # change what is generated, which _refuse_unsupported checks by name
    model_config = ConfigDict(extra="allow")

    model: str = Field(..., min_length=1, max_length=256)
    # strict numbers: JSON's true is no count, seed or temperature (pydantic would read it as 1); an int is a float
    n: int = Field(1, ge=1, strict=True)
    temperature: float | None = Field(None, ge=0, strict=True)
    top_p: float | None = Field(None, gt=0, le=1, strict=True)
    seed: int | None = Field(None, ge=0, lt=2**31, strict=True)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    max_tokens: int | None = Field(None, ge=1, strict=True)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"stop: at most {MAX_STOPS} non-empty strings of at most 256 characters")
        return stops

    @field_validator(*_NULL_IS_DEFAULT, mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value, info):
        return cls.model_fields[info.field_name].default if value is None else value

    @model_validator(mode="after")
    def _drop_ignored(self):
        extra = self.__pydantic_extra__
        for name in [name for name in extra or {} if name not in READ_EXTRAS]:
            del extra[name]
        return self

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        for name, neutral in _SAMPLING.items():
            value = extra.get(name)
            # bool is no number here: JSON's true is no penalty of 1 (Python's True == 1)
            if value is not None and (isinstance(value, bool) or value not in neutral):
                allowed = "".join(f" or {v!r}" for v in neutral)
                raise RequestError(f"{name}={_shown(value)}: not served; the endpoint samples the policy as the "
                                   f"sampler does (leave it out{allowed})")
        for name, neutral in _NEUTRAL:
            # of the neutral value's type: JSON's false is no min_tokens of 0, nor 0 an ignore_eos of false
            if name in extra and extra[name] is not None and (
                    extra[name] != neutral or isinstance(extra[name], bool) != isinstance(neutral, bool)):
                raise RequestError(f"{name}={_shown(extra[name])}: not served; leave it out (or {neutral!r})")
        if self.top_p not in (None, 1, 1.0):
            raise RequestError("top_p: only 1 (or leaving it out); the endpoint samples the whole distribution")

    def greedy(self, temperature: float) -> bool:
        """Whether to decode greedily; the temperature must be the engine's (or 0)."""
        if self.temperature is None or abs(self.temperature - temperature) < 1e-6:
            return False
        if self.temperature == 0:
            return True
        raise RequestError(f"temperature={self.temperature}: this endpoint samples at the policy's temperature "
                           f"generation.temperature={temperature} (its logprobs are the policy's at it) or greedy (0); "
                           "send one of these or leave it out")

    def budget(self, limit: int, default: int) -> int:
        asked = self.max_tokens or min(default, limit)
        if asked > limit:
            raise RequestError(f"{self.budget_field()}={asked}: more than this sampler's generation.max_new_tokens="
                               f"{limit}")
        return asked

    def budget_field(self) -> str:
        """The field the client set the new-token budget with (errors name it)."""
        return "max_tokens"


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _messages_kept(cls, value):
        return [_message_kept(message) for message in value]

    def budget_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    def check(self) -> None:
        self.refuse_unsupported()
        if self.top_logprobs:
            raise RequestError("top_logprobs: only 0; the endpoint returns each sampled token's logprob, not "
                               "alternatives")
        if self.tool_choice not in (None, "auto", "none"):
            raise RequestError("tool_choice: only 'auto' or 'none'; the model decides whether to call a tool")
        if self.max_completion_tokens is not None:  # OpenAI's newer name; it wins over max_tokens
            self.max_tokens = self.max_completion_tokens
        for i, message in enumerate(self.messages):
            if message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise RequestError(f"messages[{i}].role={_shown(message.get('role'))}: one of system, developer, "
                                   "user, assistant, tool")


class CompletionRequest(_Common):
    # strict ids: JSON's true or 1.5 is no token id (pydantic would read them as 1)
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # vLLM's: a text prompt gets what the tokenizer's post-processor adds (Llama 3's BOS); token ids are as given
    add_special_tokens: bool = True
    # strict: JSON's false was logprobs 0, which asks for them
    logprobs: int | None = Field(None, ge=0, le=20, strict=True)
    echo: bool = False
    best_of: int | None = Field(None, strict=True)

    def check(self) -> None:
        self.refuse_unsupported()
        if self.logprobs:
            raise RequestError("logprobs: only 0; the endpoint returns each sampled token's logprob, not alternatives")
        if self.echo:
            raise RequestError("echo: not served (the endpoint scores no prompt tokens)")
        if self.best_of not in (None, self.n):
            raise RequestError("best_of: not served; ask for n choices and pick among them")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: texts or token-id lists (at least one, none empty)."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise RequestError("prompt: give a non-empty text, a list of texts, token ids, or a list of token-id lists")
        return prompts


FinishReason = Literal["stop", "length", "tool_calls"]
