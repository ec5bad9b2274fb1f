"""A reasoning model's thinking (`<think>...</think>`, Qwen3, DeepSeek-R1, QwQ) is not its answer: the built-in
rewards score the reply after the last `</think>`, as lm-eval scores such a model (its think_end_token)."""

import pytest

from grpo_stream.common.tasks import ifeval_checks
from grpo_stream.common.tasks.answers import extract_answer, same_number
from grpo_stream.common.tasks.rewards import answer_correct, answer_format, last_number, reasoning_answer_format

# (a thinking model's completion, what its reply answers, what its thinking drafted)
THOUGHT = [
    ("<think>\n16 - 3 - 4 = 9, 9 * 2 = 17? So the answer is 17. Wait, 9 * 2 = 18.\n</think>\n\nThe answer is 18.",
     "18", "17"),
    ("<think>Maybe \\boxed{17}. No: 9 * 2 = 18.</think>\nShe makes \\boxed{18} dollars.", "18", "17"),
    ("<think>I will write #### 17 at the end... no, 18.</think>\n9 * 2 = 18\n#### 18", "18", "17"),
    # DeepSeek-R1's template opens the thinking in the prompt: the completion holds only its end
    ("Okay, so the answer is 17? Let me check: 9 * 2 = 18.\n</think>\n\nThe answer is 18.", "18", "17"),
    ("<think>Put it as <answer>17</answer>? No, 18.</think><reasoning>9 * 2</reasoning><answer>18</answer>",
     "18", "17"),
]


@pytest.mark.parametrize("completion, reply, draft", THOUGHT)
def test_the_thinkings_drafts_are_not_the_answer(completion, reply, draft):
    """The first statement of an answer wins (answers.extract_answer): a draft in the thinking outranked the reply's
    answer, so the right reply scored 0 and a wrong draft 1."""
    assert same_number(extract_answer(completion), reply)
    assert answer_correct(completion, reply) == 1.0 and answer_correct(completion, draft) == 0.0
    assert last_number(completion, reply) == 1.0


def test_a_reply_without_an_answer_is_no_answer_whatever_the_thinking_wrote():
    thought = "<think>9 * 2 = 18, so the answer is 18.\n#### 18</think>\nI could not decide."
    assert answer_correct(thought, "18") == 0.0 and last_number(thought, "18") == 0.0
    assert answer_format(thought, "") == 0.0  # the format's credit is the reply's, not the thinking's
    assert answer_format(thought + "\n#### 18", "") == 1.0
    assert answer_correct("no thinking: the answer is 18", "18") == 1.0  # a completion without </think>: all of it


def test_the_reasoning_format_is_the_replys():
    """The Tunix format (`<reasoning>...</reasoning><answer>...</answer>`) after a thinking model's thinking: the
    thinking before it made the format reward 0 on every completion of such a model."""
    formatted = "<reasoning>9 * 2</reasoning>\n<answer>18</answer>"
    assert reasoning_answer_format(f"<think>\nLet me think.\n</think>\n\n{formatted}", "") == 1.0
    assert reasoning_answer_format(f"<think>{formatted}</think>\nThe answer is 18.", "") == 0.0


def test_ifeval_checks_the_reply_as_lm_eval_scores_a_thinking_model():
    """The thinking's commas, capitals and words were checked against the prompt's instructions (no commas, all
    lower case, fewer than 20 words), so a reply that followed them all scored 0; lm-eval (think_end_token) scores
    the reply alone."""
    instructions = ["punctuation:no_comma", "change_case:english_lowercase", "length_constraints:number_words"]
    kwargs = [{}, {}, {"relation": "less than", "num_words": 20}]
    reference = ifeval_checks.make_reference(None, "Describe rain briefly.", instructions, kwargs)
    thinking = "<think>\nOkay, the User wants THREE things: no commas, lower case, and few words. " * 3 + "</think>"
    reply = "rain falls softly on the quiet town"
    utils = ifeval_checks.lm_eval_ifeval()[0]
    example = utils.InputExample(key=None, instruction_id_list=instructions, prompt="Describe rain briefly.",
                                 kwargs=kwargs)
    official = utils.test_instruction_following_strict(example, reply).follow_instruction_list
    assert official == [True, True, True]
    assert ifeval_checks.followed(f"{thinking}\n\n{reply}", reference) == ((True,) * 3, (True,) * 3)
    assert ifeval_checks.ifeval_strict(f"{thinking}\n\nRain, falling.", reference) < 1.0  # the reply is checked
