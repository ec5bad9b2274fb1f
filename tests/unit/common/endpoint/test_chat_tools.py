"""The OpenAI endpoint on a chat template without tool support (SmolLM2's bare ChatML, tests/chat_families.py; issue
58): a request's `tools` reach the prompt, and a conversation that goes on after the model called a tool is rendered
the same whether it is continued from the remembered ids or rendered whole (the call written as the model wrote it)."""

import json
import logging

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.endpoint.app import endpoint_core
from grpo_stream.common.endpoint.chat import template_messages
from grpo_stream.common.engine.side_requests import SideQueue
from grpo_stream.common.model.tokenizer import HFTokenizer
from grpo_stream.common.tools.calculator import math_tools
from grpo_stream.common.tools.calls import ToolCall, render_tool_call
from grpo_stream.common.tools.python_sandbox import SandboxLimits
from tests.chat_families import build_tokenizer

TOOLS = math_tools(SandboxLimits()).schemas()
QUESTION = [{"role": "user", "content": "What is 17 * 3?"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A SmolLM2-template tokenizer, loaded as a run loads it with environment.tool_format unset."""
    return HFTokenizer(build_tokenizer(tmp_path_factory.mktemp("smollm2"), "smollm2", "llama"))


def core_for(tokenizer, *overrides: str):
    """The endpoint's core with the run's settings (no engine is needed to render prompts)."""
    return endpoint_core(load_config(None, ["sampler.openai.port=0", *overrides]), None, SideQueue(8), tokenizer)


def text_of(core, ids: list[int]) -> str:
    return core.tokenizer._tok.decode(ids, skip_special_tokens=False)


def test_the_requests_tools_reach_the_prompt(tokenizer):
    """Before issue 58 the prompt was the same with or without `tools`."""
    core = core_for(tokenizer)
    prompt = text_of(core, core.chat_prompts.ids(template_messages(QUESTION), TOOLS))
    assert prompt != text_of(core, core.chat_prompts.ids(template_messages(QUESTION), None))
    assert prompt.startswith("<|im_start|>system\nYou can call these tools")
    assert all(json.dumps(schema, ensure_ascii=False) in prompt for schema in TOOLS)
    assert prompt.endswith("<|im_start|>user\nWhat is 17 * 3?<|im_end|>\n<|im_start|>assistant\n")
    assert core.tool_format == "qwen"  # inferred: the template has no tool markup of its own


def test_a_conversation_after_a_tool_call_is_the_same_continued_or_rendered_whole(tokenizer):
    """The model's answer calls a tool (sampled ids that a fresh encoding would not give); the client sends it back as
    `tool_calls` with the tool's result: the prompt continues the sampled ids, and its text is the whole
    conversation as the template renders it, the call written as the model wrote it (before issue 58 the whole
    rendering had an empty assistant turn there). The endpoint's own tool format here (sampler.openai.tool_format)."""
    core = core_for(tokenizer, "sampler.openai.tool_format=qwen")
    tok, prompts = core.tokenizer, core.chat_prompts
    messages = template_messages(QUESTION)
    prompt = prompts.ids(messages, TOOLS, caller="c")
    sampled_text = "Let me compute.\n" + render_tool_call(ToolCall("calculator", {"expression": "17 * 3"}), "qwen")
    sampled = [i for piece in sampled_text for i in tok.encode(piece)]  # one character at a time: not re-encodable
    assert sampled != tok.encode(sampled_text)
    answer, called = core._message(sampled_text, TOOLS)
    assert called and answer["content"] == "Let me compute."
    prompts.remember(messages, answer, TOOLS, prompt + sampled + tok.encode("<|im_end|>"), True, caller="c")
    follow = template_messages(QUESTION + [answer, {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"],
                                                    "content": "51"}])
    continued = prompts.ids(follow, TOOLS, caller="c")
    assert prompts.continued == 1 and continued[:len(prompt) + len(sampled)] == prompt + sampled
    whole = tok.render_chat(follow, add_generation_prompt=True, tools=TOOLS)  # the tokenizer's format: qwen too
    assert text_of(core, continued) == whole
    assert sampled_text + "<|im_end|>\n<|im_start|>tool\n51<|im_end|>\n<|im_start|>assistant\n" in whole


def test_an_endpoint_format_other_than_the_runs_is_said_and_used(tokenizer, caplog):
    caplog.set_level(logging.WARNING, logger="grpo_stream.common.endpoint.app")
    core_for(tokenizer, "sampler.openai.tool_format=qwen")
    assert not caplog.records
    core = core_for(tokenizer, "sampler.openai.tool_format=gemma")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "sampler.openai.tool_format=gemma" in said[0] and "'qwen'" in said[0]
    prompt = text_of(core, core.chat_prompts.ids(template_messages(QUESTION), TOOLS))
    assert "```tool_code\ntool_name(argument='value')\n```" in prompt


def test_a_template_without_a_tool_role_takes_a_tools_result_as_a_user_turn(tmp_path):
    """Gemma's template refuses the `tool` role: the endpoint answered 400 to the request that carried a tool's
    result, so a tool-using client (a verifiers ToolEnv) could never go past its first call on Gemma. The result is
    now a user turn, as the environments' renderer writes observations for it."""
    core = core_for(HFTokenizer(build_tokenizer(tmp_path / "gemma", "gemma", "gemma")),
                    "sampler.openai.tool_format=gemma")
    answer, called = core._message(render_tool_call(ToolCall("calculator", {"expression": "17 * 3"}), "gemma"), TOOLS)
    assert called
    follow = template_messages(QUESTION + [answer, {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"],
                                                    "content": "51"}])
    prompt = text_of(core, core.chat_prompts.ids(follow, TOOLS))
    assert prompt.endswith("<start_of_turn>user\n51<end_of_turn>\n<start_of_turn>model\n"), prompt[-200:]


def with_bos_post_processor(directory):
    """A Llama 3 tokenizer.json as shipped: its post-processor writes <|begin_of_text|> before a text."""
    path = directory / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos = next(t for t in spec["added_tokens"] if t["content"] == "<|begin_of_text|>")
    first = {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [first, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos["id"]],
                                                 "tokens": ["<|begin_of_text|>"]}}}
    path.write_text(json.dumps(spec))
    return directory, bos["id"]


def test_a_text_completion_is_encoded_as_vllm_encodes_it(tmp_path):
    """/v1/completions stands in for vLLM's, which encodes a text prompt with the tokenizer's special tokens (its
    add_special_tokens defaults to true): a Llama 3 prompt without <|begin_of_text|> is another input to the model;
    a SmolLM2 one gets nothing, though its bos_token is set (its post-processor adds none)."""
    from grpo_stream.common.endpoint.protocol import CompletionRequest

    directory, bos = with_bos_post_processor(build_tokenizer(tmp_path / "llama3", "llama3", "llama"))
    core = core_for(HFTokenizer(directory))
    plain = core.tokenizer.encode("Q: 1 + 1 = ? A:")
    ask = {"model": core.model_name, "prompt": "Q: 1 + 1 = ? A:"}
    assert core.completion_prompts(CompletionRequest(**ask)) == [[bos] + plain]
    assert core.completion_prompts(CompletionRequest(**ask, add_special_tokens=False)) == [plain]
    assert core.completion_prompts(CompletionRequest(**{**ask, "prompt": [5, 6]})) == [[5, 6]]  # ids as given
    smol = core_for(HFTokenizer(build_tokenizer(tmp_path / "smollm2", "smollm2", "llama")))
    assert smol.completion_prompts(CompletionRequest(**ask)) == [smol.tokenizer.encode("Q: 1 + 1 = ? A:")]
