"""A turn of several tool calls is answered as the family's chat template writes an OpenAI-style conversation's tool
results: one tool message per call (Qwen: a <tool_response> each in one user turn; Llama 3.1: an ipython turn each),
not all results joined in one message; Gemma, whose template has no tool role, reads them as one user turn."""

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.environments.arith_tools import ArithToolsEnvironment
from grpo_stream.common.environments.gsm8k_tools import environment_for
from grpo_stream.common.environments.render import ChatTemplateRenderer
from grpo_stream.common.model.tokenizer import HFTokenizer
from grpo_stream.common.tools.calls import ToolCall, render_tool_call, render_tool_calls
from tests.chat_families import FAMILIES, build_tokenizer

CALLS = [ToolCall("calculator", {"expression": "17 * 3"}), ToolCall("calculator", {"expression": "2 + 4"})]
# what each family's template writes after the model's stop token for the tool results "51" and "6"
AFTER_STOP = {
    "qwen": "\n<|im_start|>user\n<tool_response>\n51\n</tool_response>\n<tool_response>\n6\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n",
    "llama3": '<|start_header_id|>ipython<|end_header_id|>\n\n"51"<|eot_id|><|start_header_id|>ipython'
              '<|end_header_id|>\n\n"6"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
    "gemma": "\n<start_of_turn>user\n51\n6<end_of_turn>\n<start_of_turn>model\n",
}


@pytest.mark.parametrize("name", sorted(AFTER_STOP))
def test_each_call_of_a_turn_is_answered_in_its_own_tool_message(tmp_path, name):
    family = FAMILIES[name].calls
    episode = environment_for(load_config(None, [f"environment.tool_format={family}"])).start(None)
    observation = episode.step(render_tool_calls(CALLS, family)).observation
    assert observation.content == "51\n6" and observation.parts == ("51", "6")
    renderer = ChatTemplateRenderer(HFTokenizer(build_tokenizer(tmp_path / name, name)))
    assert renderer.text(observation) == AFTER_STOP[name]


def test_one_call_and_a_phrased_answer_are_one_message():
    episode = environment_for(load_config(None, ["environment.tool_format=qwen"])).start(None)
    assert episode.step(render_tool_call(CALLS[0], "qwen")).observation.parts == ()
    demo = ArithToolsEnvironment("plain").start(None)  # the tiny model's phrase: the first call's sum alone
    observation = demo.step("<call>add(1, 2)</call> <call>add(3, 4)</call>").observation
    assert observation.content == "= 3" and observation.parts == ()
