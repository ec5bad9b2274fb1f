"""Tools for any chat template (issue 58): a template that ignores `tools=` and `tool_calls` (SmolLM2's bare ChatML,
tests/chat_families.py) gets the tool schemas in its system turn and the calls in its assistant turns, in the tool
format's own style, said once in the log; a template that writes them itself is left as it is; the tool format is
inferred from the template when environment.tool_format is unset, and an explicit one wins."""

import json
import logging

import jinja2
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.environments.tool_episode import run_tool_format
from grpo_stream.common.model.tokenizer import HFTokenizer, train_bpe
from grpo_stream.common.tasks import prompts
from grpo_stream.common.tasks.arith import ArithTask
from grpo_stream.common.tools.calculator import math_tools
from grpo_stream.common.tools.calls import FAMILIES, ToolCall, parse_tool_calls, render_tool_calls
from grpo_stream.common.tools.python_sandbox import SandboxLimits
from grpo_stream.common.tools.template_tools import DEFAULT_FORMAT, ToolSupport, for_template, infer_tool_format, probe
from tests.chat_families import FAMILIES as CHAT_FAMILIES, SMOLLM2_TEMPLATE, build_tokenizer

TOOLS = math_tools(SandboxLimits()).schemas()
USER = {"role": "user", "content": "What is 17 * 3?"}
CALLS = [ToolCall("calculator", {"expression": "17 * 3"}), ToolCall("python", {"code": "print(17 * 3)"})]
MODEL_TYPES = {"qwen": "qwen2", "llama3": "llama", "gemma": "gemma2", "smollm2": "llama"}
FALLBACK_LOG = "chat template does not write"


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """name -> a directory with the chat family's tokenizer files and a config.json naming its model_type."""
    root = tmp_path_factory.mktemp("template_tools")
    return {name: build_tokenizer(root / name, name, MODEL_TYPES[name]) for name in CHAT_FAMILIES}


def template_call(call: ToolCall, arguments_as_text: bool = False) -> dict:
    """A call as an OpenAI client (arguments as JSON text) or a chat template (an object) writes it."""
    arguments = json.dumps(dict(call.arguments)) if arguments_as_text else dict(call.arguments)
    return {"id": f"call_{call.name}", "type": "function", "function": {"name": call.name, "arguments": arguments}}


def test_a_bare_chatml_template_writes_neither_tools_nor_calls_and_others_do(tokenizer_dirs):
    support = {name: HFTokenizer(directory).tool_support for name, directory in tokenizer_dirs.items()}
    assert support["smollm2"] == ToolSupport(schemas=False, calls=False, system=True)
    assert support["gemma"] == ToolSupport(schemas=False, calls=False, system=True)
    assert support["qwen"].complete and support["llama3"].complete


def test_the_gsm8k_tools_prompt_lists_the_tools_in_the_system_turn(tokenizer_dirs):
    """The gsm8k_tools prompt (task.prompt_template=tools) with SmolLM2's template: before issue 58 it listed no tool
    at all; now the system turn holds the task's instructions, every schema and a call written in the format."""
    tok = HFTokenizer(tokenizer_dirs["smollm2"])
    prompt = prompts.render("What is 17 * 3?", "tools", tok, TOOLS)
    system, rest = prompt.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\n" + prompts.TOOLS_SYSTEM + "\n\n")
    for schema in TOOLS:
        assert json.dumps(schema, ensure_ascii=False) in system
    assert '<tool_call>\n{"name": "tool_name", "arguments": {"argument": "value"}}\n</tool_call>' in system
    assert rest == "<|im_start|>user\nWhat is 17 * 3?<|im_end|>\n<|im_start|>assistant\n"
    without_system = tok.render_chat([USER], add_generation_prompt=True, tools=TOOLS)
    assert without_system.startswith("<|im_start|>system\nYou can call these tools") and "SmolLM" not in without_system


@pytest.mark.parametrize("tool_format", FAMILIES)
def test_a_demonstrated_call_renders_as_the_format_writes_and_parses_it(tokenizer_dirs, tool_format):
    """An assistant message's tool_calls (arguments as objects or as an OpenAI client's JSON text) are written at the
    end of its content by the format's own writer: the format's parser reads back exactly the calls, as it reads a
    sampled one. Before issue 58 the assistant turn rendered empty."""
    tok = HFTokenizer(tokenizer_dirs["smollm2"], tool_format=tool_format)
    calls = CALLS[:1] if tool_format == "llama3" else CALLS
    for as_text in (False, True):
        answer = {"role": "assistant", "content": "Let me compute.",
                  "tool_calls": [template_call(c, as_text) for c in calls]}
        text = tok.render_chat([USER, answer, {"role": "tool", "content": "51"}], add_generation_prompt=True)
        turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
        written = render_tool_calls(calls, tool_format)
        separator = " " if tool_format == "plain" else "\n"
        assert turn == (written if tool_format == "llama3" else f"Let me compute.{separator}{written}")
        assert parse_tool_calls(turn, tool_format) == calls
        assert text.endswith("<|im_start|>tool\n51<|im_end|>\n<|im_start|>assistant\n")


def test_a_call_the_format_cannot_write_names_the_format(tokenizer_dirs):
    tok = HFTokenizer(tokenizer_dirs["smollm2"], tool_format="gemma")
    answer = {"role": "assistant", "content": "", "tool_calls": [template_call(ToolCall("not-a-name", {}))]}
    with pytest.raises(ValueError, match="cannot be written in the 'gemma' tool format"):
        tok.render_chat([USER, answer], add_generation_prompt=False)



@pytest.mark.parametrize("family", FAMILIES)
def test_a_clients_call_arguments_nested_too_deep_are_refused_naming_the_call(family):
    """JSON arguments nested past the recursion limit raised RecursionError out of the template's tool-call writer
    (the endpoint's 400 then blamed the chat template); now a ValueError naming the call."""
    call = {"function": {"name": "calculator", "arguments": "[" * 100_000 + "]" * 100_000}}
    answer = {"role": "assistant", "content": "", "tool_calls": [call]}
    with pytest.raises(ValueError, match="the call of 'calculator' are JSON nested too deep"):
        for_template([USER, answer], TOOLS, family, ToolSupport(schemas=False, calls=False))

@pytest.mark.parametrize("positional", [5, "ab", None, {"a": 1}])
def test_plain_positional_arguments_that_are_not_a_list_are_named(positional):
    """A client's assistant message carries the 'plain' format's positional arguments as "_positional": anything but
    a list raised TypeError (the endpoint's 400 then spoke of the chat template), or a string became one argument
    per character."""
    call = {"function": {"name": "calculator", "arguments": {"_positional": positional}}}
    answer = {"role": "assistant", "content": "", "tool_calls": [call]}
    with pytest.raises(ValueError, match='"_positional" of the call of \'calculator\' must be a list'):
        for_template([USER, answer], TOOLS, "plain", ToolSupport(schemas=False, calls=False))
    call["function"]["arguments"]["_positional"] = ["17 * 3"]
    messages, _ = for_template([USER, answer], TOOLS, "plain", ToolSupport(schemas=False, calls=False))
    assert messages[-1]["content"] == "<call>calculator('17 * 3')</call>"


def test_the_fallback_is_said_once_in_the_log_naming_the_model_and_format(tokenizer_dirs, caplog):
    caplog.set_level(logging.INFO, logger="grpo_stream.common.model.tokenizer")
    tok = HFTokenizer(tokenizer_dirs["smollm2"])
    for question in ("a", "b", "c"):
        prompts.render(question, "tools", tok, TOOLS)
        tok.render_chat([USER, {"role": "assistant", "content": "", "tool_calls": [template_call(CALLS[0])]}], False)
    said = [r for r in caplog.records if FALLBACK_LOG in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    line = said[0].getMessage()
    assert str(tokenizer_dirs["smollm2"]) in line and "'qwen'" in line and "tool schemas" in line and "tool calls" in line
    inferred = [r.getMessage() for r in caplog.records if "environment.tool_format unset" in r.getMessage()]
    assert len(inferred) == 1 and "'qwen'" in inferred[0]
    caplog.clear()
    HFTokenizer(tokenizer_dirs["qwen"], tool_format="qwen")
    assert not [r for r in caplog.records if FALLBACK_LOG in r.getMessage() or "unset" in r.getMessage()]


@pytest.mark.parametrize("name", ["qwen", "llama3"])
def test_templates_that_write_tools_render_as_before(tokenizer_dirs, name):
    """Byte-identical to the template's own rendering (the path before issue 58), whatever tool_format is asked."""
    tok = HFTokenizer(tokenizer_dirs[name])
    answer = {"role": "assistant", "content": "", "tool_calls": [template_call(CALLS[0])]}
    conversations = [([USER], True), ([USER, answer, {"role": "tool", "content": "51"}], True), ([USER, answer], False)]
    for messages, generation in conversations:
        own = tok._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, tools=TOOLS)
        for tool_format in (None, *FAMILIES):
            assert tok.render_chat(messages, generation, tools=TOOLS, tool_format=tool_format) == own


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_turn():
    refuses_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                      "{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")

    def render(messages, add_generation_prompt, tools):
        env = jinja2.Environment()
        env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(jinja2.TemplateError(message))
        return env.from_string(refuses_system).render(messages=messages, tools=tools)

    support = probe(render)
    assert support == ToolSupport(schemas=False, calls=False, system=False)
    messages, tools = for_template([USER], TOOLS, "qwen", support)
    assert tools is None and [m["role"] for m in messages] == ["user"]
    assert messages[0]["content"].startswith("You can call these tools") and messages[0]["content"].endswith(
        "\n\nWhat is 17 * 3?")


@pytest.mark.parametrize("template, model_type, expected", [
    (CHAT_FAMILIES["qwen"].template, "qwen2", "qwen"),
    (CHAT_FAMILIES["llama3"].template, "llama", "llama3"),
    (CHAT_FAMILIES["gemma"].template, "gemma2", "gemma"),
    (SMOLLM2_TEMPLATE, "llama", DEFAULT_FORMAT),          # Llama architecture, bare ChatML: no Llama 3 JSON calls
    (SMOLLM2_TEMPLATE, "qwen2", "qwen"),                  # Qwen2's own template is bare ChatML too
    (SMOLLM2_TEMPLATE, "gemma3_text", "gemma"),
    (None, "llama", "plain"),                             # no chat template (the tiny model's tokenizer)
])
def test_the_tool_format_is_inferred_from_the_template_then_the_family(template, model_type, expected):
    assert infer_tool_format(template, model_type)[0] == expected


def test_an_unset_tool_format_is_inferred_and_an_explicit_one_wins(tokenizer_dirs):
    assert load_config(None, []).environment.tool_format is None
    inferred = {name: HFTokenizer(directory).tool_format for name, directory in tokenizer_dirs.items()}
    assert inferred == {"qwen": "qwen", "llama3": "llama3", "gemma": "gemma", "smollm2": DEFAULT_FORMAT}
    unset = load_config(None, [])
    assert run_tool_format(unset, HFTokenizer(tokenizer_dirs["llama3"])) == "llama3"
    assert run_tool_format(unset, train_bpe(ArithTask(10, 99, 0.1, seed=0).corpus(200), 120)) == "plain"
    explicit = load_config(None, ["environment.tool_format=gemma"])
    tok = HFTokenizer(tokenizer_dirs["smollm2"], tool_format=explicit.environment.tool_format)
    assert tok.tool_format == run_tool_format(explicit, tok) == "gemma"
    assert "```tool_code" in tok.render_chat([USER], True, tools=TOOLS)
