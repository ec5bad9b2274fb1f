"""Observations the tokenizers can encode whatever a tool call held (common/environments/render.py)."""

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.environments.gsm8k_tools import environment_for
from grpo_stream.common.environments.render import ChatTemplateRenderer, PlainRenderer, well_formed

# JSON escapes of lone surrogates, which Python's json reads into the call: an unknown tool's name, an unknown argument
LONE = ['<tool_call>\n{"name": "calc\\ud800", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "calculator", "arguments": {"x\\udc00": "1"}}\n</tool_call>']


def _observation(text: str):
    cfg = load_config(None, ["environment.tool_format=qwen"])
    return environment_for(cfg).start(None).step(text).observation


@pytest.mark.parametrize("name", ["qwen", "llama3", "gemma"])
def test_an_error_echoing_a_lone_surrogate_renders_in_every_family(tmp_path, name):
    """An error naming a call whose JSON held `\\ud800` echoed the lone surrogate; the tokenizer refused to encode it
    (TypeError) and the episode ended with that error instead of the model reading what was wrong."""
    from grpo_stream.common.model.tokenizer import HFTokenizer  # noqa: PLC0415 - transformers: loaded only here
    from tests.chat_families import build_tokenizer  # noqa: PLC0415

    renderer = ChatTemplateRenderer(HFTokenizer(build_tokenizer(tmp_path / name, name)))
    for text in LONE:
        observation = _observation(text)
        assert observation.content.startswith("error:")
        assert renderer.render(observation) and "\ufffd" in renderer.text(observation)


def test_an_error_echoing_a_lone_surrogate_renders_as_plain_text(tiny_parts):
    renderer = PlainRenderer(tiny_parts[2])
    for text in LONE:
        assert renderer.render(_observation(text))


def test_well_formed_replaces_only_lone_surrogates():
    assert well_formed("a\ud800b") == "a\ufffdb" and well_formed("x\udc00") == "x\ufffd"
    assert well_formed("\ud83d\ude00") == "\U0001F600"  # a pair written as two code points: the character
    assert well_formed("é 😀 <|im_end|>") == "é 😀 <|im_end|>"
