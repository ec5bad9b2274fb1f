"""Final-answer extraction, number normalisation and pluggable rewards."""

import itertools
import math

import pytest

from grpo_stream.common.tasks.answers import extract_answer, parse_number, reference_answer, same_number
from grpo_stream.common.tasks.rewards import (DEFAULT_WEIGHTS, REWARDS, RewardSet, RunRewards, UnknownReward,
                                              answer_correct, last_number,
                                              reasoning_answer_format, resolve, score)

# (written by a model, reference, equal?)
TRICKY = [
    ("1,234", "1234", True), ("$1,234.00", "1234", True), ("1 234", "1234", True), ("1_000", "1000", True),
    ("50%", "50", True), ("10.50", "10.5", True), ("7.", "7", True), ("3.000", "3", True),
    ("3/4", "0.75", True), ("1 1/2", "1.5", True), ("\\frac{3}{4}", ".75", True), ("\\dfrac{6}{8}", "3/4", True),
    ("0.33", "1/3", True), ("0.3", "1/3", False), ("\u22125", "-5", True), ("+5", "5", True),
    ("18 dollars", "18", True), ("€20", "20", True), ("USD 20", "20", True), ("20 cents", "20", True),
    ("12", "13", False), ("1,23", "123", False), ("abc", "1", False), ("1/0", "1", False), ("", "0", False),
    ("-0", "0", True), ("1e3", "1000", False),  # scientific notation is not how GSM8K answers are written
    # a rounding matches only a value with no exact decimal: 1.004 and 0.125 are written exactly
    ("1.00", "1.004", False), ("0.334", "0.33", False), ("12.499", "12.50", False), ("0.12", "1/8", False),
    ("0.67", "2/3", True), ("\\$18", "18", True), ("18,", "18", True),
    ("1{,}080", "1080", True), ("\\$1{,}234.50", "1234.5", True), ("18\u202f000", "18000", True),  # LaTeX, French
]


@pytest.mark.parametrize("got, reference, equal", TRICKY)
def test_tricky_answer_formats(got, reference, equal):
    assert same_number(got, reference) is equal
    assert same_number(reference, got) is equal  # symmetric


@pytest.mark.parametrize("text, stated", [
    ("so 47 + 38 = 85 #### 85 apples", "85"),
    ("<reasoning>48/2 = 24</reasoning><answer>$1,000</answer>", "$1,000"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("The answer is 42.", "42."),
    ("The final answer is: 7", "7"),
    ("<answer>x = 12</answer> #### 13", "12"),  # the answer tag wins over ####
    ("no stated answer 5", None),
    ("#### none", None),
    ("#### Step 1: add them\nso \\boxed{18}", "18"),  # a markdown heading is not a #### answer
    ("#### Step 1\nShe has 9+9=18.\n#### 18", "18"),  # a heading, then the answer
    ("She has 18.\n#### **18**", "18"),  # bold
    # restating the requested format is no answer: the tag that holds one is
    ("I will put the final answer between <answer> and </answer>.\n<reasoning>9+9</reasoning><answer>18</answer>",
     "18"),
    ("#### \u22127 degrees", "-7"), ("The answer is \u22127.", "-7"),  # the Unicode minus keeps its sign
])
def test_extract_answer_by_format(text, stated):
    got = extract_answer(text)
    if stated is None:
        assert got is None
    else:
        assert got is not None and same_number(got, stated)


def test_reference_answer_and_bad_reference():
    assert reference_answer("48/2 = 24\n#### 72") == "72"
    with pytest.raises(ValueError, match="####"):
        reference_answer("no final answer")
    assert parse_number("72") == 72


def test_builtin_rewards_and_weights():
    total, parts = score("<reasoning>r</reasoning><answer>85</answer>", "85",
                         {"answer_correct": 1.0, "reasoning_answer_format": 0.5, "answer_format": 0.1})
    assert parts == {"answer_correct": 1.0, "reasoning_answer_format": 1.0, "answer_format": 0.0}
    assert math.isclose(total, 1.5)
    assert reasoning_answer_format("text <reasoning>r</reasoning><answer>1</answer>", "1") == 0.0


def length_penalty(text: str, reference: str) -> float:
    """A user reward, imported by path in the test below."""
    return -len(text) / 100


def test_reward_by_import_path():
    rewards = RewardSet({"answer_correct": 1.0, f"{__name__}:length_penalty": 2.0})
    total, parts = rewards.score("#### 85", "85")
    assert parts[f"{__name__}:length_penalty"] == -0.07 and math.isclose(total, 1.0 - 0.14)


@pytest.mark.parametrize("name, message", [
    ("not_a_reward", "task.rewards.not_a_reward: not a built-in reward"),
    ("json:nope", "task.rewards.json:nope: cannot import it"),
    ("no_such_module_xyz:f", "task.rewards.no_such_module_xyz:f: cannot import it"),
    ("math:pi", "task.rewards.math:pi: float is not callable"),
])
def test_bad_reward_names_are_refused_with_the_setting(name, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        resolve(name)


def test_a_failing_user_reward_is_named():
    rewards = RewardSet({"math:sqrt": 1.0})  # sqrt(str) raises TypeError
    with pytest.raises(ValueError, match="task.rewards.math:sqrt raised TypeError"):
        rewards.score("x", "1")


def test_a_total_past_what_the_trainer_accepts_is_an_error_naming_the_reward():
    """Each component was checked finite, the weighted total was not: a reward answering 1e308 at weight 2 made it
    inf (and 1e7 passed), which the trainer's ingest refuses group after group, never stopping the sampler."""
    huge = RewardSet({"user:huge": 2.0, "answer_format": 0.1}, {"user:huge": lambda text, reference: 1e308})
    with pytest.raises(ValueError, match=r"the total inf \(task.rewards.user:huge = 1e\+308 x 2\).*scale") as err:
        huge.score("#### 5", "5")
    assert err.value.reward == "user:huge"
    with pytest.raises(ValueError, match="not within"):
        RewardSet({"user:big": 1.0}, {"user:big": lambda text, reference: 1e7}).score("x", "5")
    assert RewardSet({"user:big": 1.0}, {"user:big": lambda text, reference: 1e6}).score("x", "5")[0] == 1e6


def test_accuracy_is_computed_whatever_the_weights():
    total, parts = RewardSet({"reasoning_answer_format": 1.0}).score("<reasoning>r</reasoning><answer>7</answer>", "7")
    assert parts == {"answer_correct": 1.0, "reasoning_answer_format": 1.0} and total == 1.0  # accuracy unweighted
    assert answer_format_of("#### Step 1: add") == 0.0 and answer_format_of("#### 12 apples") == 1.0
    # answer_format reads `#### N` as answer_correct does: past a heading, in bold, before a comma, LaTeX's dollar
    for stated in ("#### Step 1\nShe has 9+9=18.\n#### 18", "#### **18**", "#### 18,", "#### \\$18"):
        assert answer_format_of(stated) == 1.0 and answer_correct(stated, "18") == 1.0, stated
    assert last_number("The temperature ends at \u22127 degrees.", "7") == 0.0
    assert last_number("The temperature ends at \u22127 degrees.", "-7") == 1.0


def test_the_last_number_reads_latex_thousands_as_one_number():
    """A chat reply ending in `\\boxed{1{,}080}` (LaTeX's thousands separator, as MATH-style solutions write it)
    states 1080: the last number is not the `080` after the braces."""
    for reply in ("So the total is \\boxed{1{,}080}.", "She earns $\\$1{,}080$ in all."):
        assert last_number(reply, "1080") == 1.0 and last_number(reply, "80") == 0.0, reply
        assert answer_correct(reply.replace("She earns", "The answer is"), "1080") == 1.0


def answer_format_of(text: str) -> float:
    from grpo_stream.common.tasks.rewards import answer_format

    return answer_format(text, "")


def test_injected_reward_names_resolve_among_the_runs_only():
    """A prompt may name the built-ins and the run's own rewards (an import path the operator configured included)
    but no other import path: it is refused by name, never imported."""
    configured = {"answer_correct": 1.0, f"{__name__}:length_penalty": 2.0}
    run = RunRewards(RewardSet(configured), configured)
    assert run.subset([]) is run.default
    chosen = run.subset([f"{__name__}:length_penalty", "reasoning_answer_format"])
    assert chosen.weights == {"answer_correct": 0.0, f"{__name__}:length_penalty": 2.0, "reasoning_answer_format": 1.0}
    for name in ("os:system", "json:loads", "math:sqrt"):
        with pytest.raises(UnknownReward, match=rf"rewards\[1\]: '{name}' is not one of this run's rewards "):
            run.subset(["answer_format", name])
    # the IFEval checks run lm-eval's code on the prompt's reference: offered to an IFEval run only
    with pytest.raises(UnknownReward, match="'ifeval_strict' is not one of this run's rewards"):
        run.subset(["ifeval_strict"])
    assert "ifeval_strict" in RunRewards(RewardSet(configured), configured, task_name="ifeval").subset(
        ["ifeval_strict"]).weights


def test_the_reward_subsets_a_sampler_keeps_are_bounded():
    """A stream of prompts naming the run's rewards in every order keeps at most `max_cached` sets, the most
    recently used; a set asked for again is the same object (resolved once)."""
    run = RunRewards(RewardSet(DEFAULT_WEIGHTS), DEFAULT_WEIGHTS, max_cached=4, task_name="ifeval")
    names = sorted(REWARDS)
    orders = [list(p) for k in range(1, len(names) + 1) for p in itertools.permutations(names, k)]
    assert len(orders) > 4 * len(names)  # every order of every subset of the built-ins: many more than are kept
    for order in orders * 3:
        run.subset(order)
    assert list(run.cached) == [tuple(o) for o in orders[-4:]]
    assert run.subset(orders[-1]) is run.cached[tuple(orders[-1])]
    assert run.subset(["answer_format", "answer_format"]) is run.subset(["answer_format"])  # duplicates: one set


def test_an_unclosed_answer_tag_repeated_is_read_in_linear_time():
    """`<answer>\\s*(.*?)\\s*</answer>` tried every `<answer>` against the rest of the text when none was closed:
    43 s for 128k characters of a degenerate completion, holding the GIL of whatever scored it."""
    import time
    text = "<answer>" * 16_000
    started = time.perf_counter()
    assert extract_answer(text) is None and extract_answer(text + "</answer>") is None
    assert extract_answer("<answer>" * 16_000 + " 7 </answer>") == "7"  # the first tag holds the rest
    assert time.perf_counter() - started < 1.0


def test_answer_tags_are_read_as_the_pattern_read_them():
    """The linear reading finds what the pattern found, in order, on random mixes of tags, whitespace and text."""
    import random
    import re

    from grpo_stream.common.tasks.answers import _answer_tags
    pattern = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.S)
    pieces = ["<answer>", "</answer>", " ", "\n", "\u00a0", "\u2003", "5", "x", "<answer", "</answer", ">", "\t"]
    rng = random.Random(0)
    for _ in range(20_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(14)))
        assert list(_answer_tags(text)) == [m.group(1) for m in pattern.finditer(text)], repr(text)
    assert extract_answer("<answer>\n 1,234 </answer> then <answer>9</answer>") == "1,234"


def test_the_reasoning_format_is_read_in_linear_time():
    """`^\\s*<reasoning>.+?</reasoning>\\s*<answer>.+?</answer>\\s*$` tried every `</reasoning>` against the rest of
    the text for a closing `</answer>`: 11 s on 256k characters of the format restated and never closed."""
    import time
    text = "<reasoning>x</reasoning><answer>" * 8_000
    started = time.perf_counter()
    assert reasoning_answer_format(text, "") == 0.0 and reasoning_answer_format(text + "7</answer>", "") == 1.0
    assert time.perf_counter() - started < 1.0


def test_the_reasoning_format_is_read_as_the_pattern_read_it():
    """The linear reading accepts what the pattern matched, on random mixes of tags, whitespace and text."""
    import random
    import re
    pattern = re.compile(r"^\s*<reasoning>.+?</reasoning>\s*<answer>.+?</answer>\s*$", re.S)
    pieces = ["<reasoning>", "</reasoning>", "<answer>", "</answer>", " ", "\n", "\u2003", "x", "7", "<", ">"]
    rng = random.Random(0)
    matched = 0
    for _ in range(30_000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(10)))
        if rng.random() < 0.5:  # most random mixes do not match: build ones that nearly do
            text = f"{rng.choice(pieces)}<reasoning>{text}</reasoning>{rng.choice(pieces)}<answer>{rng.choice(pieces)}"
            text += f"</answer>{rng.choice(pieces)}"
        expected = pattern.match(text) is not None
        matched += expected
        assert reasoning_answer_format(text, "") == float(expected), repr(text)
    assert matched > 500  # both answers are exercised


@pytest.mark.parametrize("text, value", [
    ("#### - 3", "-3"), ("#### - $5", "-5"), ("<answer>- 3</answer>", "-3"), ("\\boxed{- 3}", "-3"),
    ("The answer is - 3.", "-3"), ("<answer>-\u20093 degrees</answer>", "-3"), ("#### + 5", "5"),
    ("The answer is:\n- 18 eggs", "18"),  # a list item under the statement: its bullet is no minus sign
])
def test_a_sign_spaced_from_its_number_is_kept(text, value):
    """`#### - 3` was read as 3: the wrong sign scored as right (1.0 against a reference of 3, 0.0 against -3)."""
    opposite = str(-int(value))
    assert answer_correct(text, value) == 1.0 and answer_correct(text, opposite) == 0.0, text


@pytest.mark.parametrize("reply", [
    "#### 1. Eggs left\n16 - 3 - 4 = 9\n#### 2. Money\n9 * 2 = 18\n\nSo she makes \\boxed{18} dollars.",
    "#### 1) Eggs left\n9 eggs\n#### 2) Money\nThe answer is 18.",
    "#### **1: Eggs left**\n9 eggs\n#### 2: Money\n<answer>18</answer>",
])
def test_numbered_markdown_headings_are_no_answers(reply):
    """A chat reply's `#### 1. Eggs left` heading was taken for its answer (1), outranking the \\boxed{18} it
    concluded with, and earned answer_format's credit though the reply states no `#### N`."""
    assert same_number(extract_answer(reply), "18"), reply
    assert answer_correct(reply, "18") == 1.0 and answer_correct(reply, "1") == 0.0
    assert answer_format_of(reply) == 0.0
    assert answer_format_of(reply + "\n#### 18") == 1.0 and answer_correct("#### 1. Eggs\n#### 18", "18") == 1.0
    assert answer_correct("#### 3.5 hours", "3.5") == 1.0 and answer_correct("#### 18 apples", "18") == 1.0


@pytest.mark.parametrize("reply, last", [
    ("She works 3-4 hours.", "4"), ("It was due 2023-05-01", "1"), ("days spent on Orbius-5", "5"),
    ("It ends at -3.", "-3"), ("x = -3", "-3"), ("(-3)", "-3"), ("It drops to \u22127", "-7"),
])
def test_a_hyphen_after_a_letter_or_digit_is_no_minus_sign(reply, last):
    """`3-4` (a range, a date, a name) made the last number -4: a wrong sign for `last_number`."""
    assert last_number(reply, last) == 1.0, reply
    assert last_number(reply, str(-int(last))) == 0.0, reply


@pytest.mark.parametrize("reply, value, misread", [
    ("So she walks \\boxed{2\\frac{1}{2}} miles.", "2.5", "10.5"),  # a LaTeX mixed number: was 21/2
    ("The answer is $3\\dfrac{3}{4}$ cups.", "3.75", "33/4"),
    ("\\boxed{\\frac12}", "0.5", "12"),  # TeX's one-digit arguments: was twelve
    ("\\boxed{\\tfrac{1}{2}}", "0.5", "1"),  # \tfrac: was its numerator
    ("\\boxed{\\frac {3} {4}}", "0.75", "3"),
    ("She saves \\boxed{1\\,250} dollars.", "1250", "1"),  # LaTeX's thin space between digit groups: was 1
    ("The answer is $\\$12\\,345.50$.", "12345.5", "12"),
    ("#### 2 100/200", "2.5", "10.5"),  # a mixed number with a 3-digit numerator is no thousands group
])
def test_latex_fractions_and_digit_groups_are_read_as_written(reply, value, misread):
    """LaTeX a model writes in \\boxed{} (MATH-style training) was read as another number: `2\\frac{1}{2}` as 21/2,
    `\\frac12` as 12, `1\\,250` as 1, so the right answer scored 0 (and the misreading 1)."""
    assert answer_correct(reply, value) == 1.0 and answer_correct(reply, misread) == 0.0, reply
    assert last_number(reply, value) == 1.0 and last_number(reply, misread) == 0.0, reply
