"""Every task renders its questions through the chat template when asked (task.prompt_template, task.system_prompt),
by one path: the samplers' problems, evaluation's held-out problems, injected questions and the OpenAI endpoint's
rendering of the same messages agree token for token; the tiny demo's plain prompts stay as they were."""

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.endpoint.chat import ChatPrompts
from grpo_stream.common.model.tokenizer import HFTokenizer
from grpo_stream.common.tasks import arith, arith_tools, gsm8k, prompts
from grpo_stream.common.tasks.registry import build_task_for
from grpo_stream.common.tasks.rewards import RewardSet
from tests.chatml_tokenizer import chatml_tokenizer_dir

SYSTEM = "Answer with the number only."


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return HFTokenizer(chatml_tokenizer_dir(tmp_path_factory.mktemp("chatml")), pad_token="<|endoftext|>")


@pytest.mark.parametrize("build", [arith.build, arith_tools.build])
def test_the_arith_tasks_render_chat_prompts_as_the_endpoint_does(chatml, build):
    cfg = load_config(None, ["task.prompt_template=chat", f"task.system_prompt={SYSTEM}"])
    task, tokenizer = build(cfg, chatml)
    assert tokenizer is chatml
    problem = task.heldout(1)[0]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": problem.question}]
    assert problem.prompt == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{problem.question}"
                              "<|im_end|>\n<|im_start|>assistant\n")
    assert not problem.prompt.startswith("<|im_start|>Q:")  # the question is no longer a role header
    assert chatml.encode(problem.prompt) == ChatPrompts(chatml).ids(messages, None)  # the endpoint's ids
    assert task.render_question(problem.question) == problem.prompt  # `grpo-stream submit --question`
    assert next(task.train_stream(0, 1)).prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_without_a_system_prompt_the_template_writes_its_own_default(chatml):
    task, _ = arith.build(load_config(None, ["task.prompt_template=chat"]), chatml)
    assert task.heldout(1)[0].prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_gsm8k_takes_the_system_prompt_too(chatml, tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "What is 12 + 7?", "answer": "12 + 7 = 19 #### 19"}\n')
    (tmp_path / "test.jsonl").write_text('{"question": "What is 3 + 4?", "answer": "#### 7"}\n')
    cfg = load_config(None, ["task.name=gsm8k", f"task.dataset.source={tmp_path}", "warmstart.steps=0",
                             "task.prompt_template=reasoning", f"task.system_prompt={SYSTEM}"])
    task, _ = gsm8k.build(cfg, chatml)
    assert task.heldout(1)[0].prompt.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>")
    assert prompts.REASONING_SYSTEM not in task.heldout(1)[0].prompt


def test_the_tiny_demo_keeps_its_plain_prompts_byte_for_byte():
    task, tokenizer = build_task_for(load_config("configs/tiny_arith.yaml", []), None)
    problem = task.heldout(1)[0]
    assert problem.prompt == f"Q: {problem.question} A:" and task.render_question("x") == "Q: x A:"


def test_templates_a_task_cannot_render_are_refused_naming_the_field(chatml):
    with pytest.raises(ValueError, match="task.prompt_template=tools: task.name=arith takes plain, chat, reasoning"):
        arith.build(load_config(None, ["task.prompt_template=tools"]), chatml)
    with pytest.raises(ValueError, match="task.prompt_template=chat: this tokenizer has no chat template"):
        arith.build(load_config(None, ["task.prompt_template=chat", "warmstart.steps=0"]), None)
    with pytest.raises(ValueError, match="task.system_prompt needs a chat-form task.prompt_template"):
        load_config(None, [f"task.system_prompt={SYSTEM}"])


def test_the_last_number_reward_reads_a_chat_reply():
    rewards = RewardSet({"last_number": 1.0})
    assert rewards.score("12 + 7 = 19.", "19") == (1.0, {"answer_correct": 0.0, "last_number": 1.0})
    assert rewards.score("It is 19, not 18", "19")[0] == 0.0
    assert rewards.score("She has 1,234 apples in all.", "1234")[0] == 1.0
    assert rewards.score("I cannot tell.", "19")[0] == 0.0
