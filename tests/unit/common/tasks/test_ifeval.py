"""The ifeval task: rewards and metrics equal lm-eval's own IFEval scoring on prompts in google/IFEval's format
(tests/data/ifeval), the shipped Punkt model, bad rows, sharding and prompt templates."""

import dataclasses
import hashlib
import json
import logging
import pathlib
import re
import time

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.tasks import ifeval, ifeval_checks
from grpo_stream.common.tasks.gsm8k import DatasetError
from grpo_stream.common.tasks.rewards import REWARDS, RewardSet

ROOT = pathlib.Path(__file__).resolve().parents[4]
DATA = ROOT / "tests" / "data" / "ifeval"
REPEAT = ("Write an email to my boss telling him that I am quitting. The email must contain a title wrapped in double "
          "angular brackets, i.e. <<title>>.")
LOWER = "what are the two young boys holding, and why do they carry toy guns and horns on the street?"
SECTIONS = "SECTION 1\nI miss math.\nSECTION 2\nI miss art.\nSECTION 3\nI miss gym.\nSECTION 4\nI miss lunch. "
MONEY = "Can I get my money back for the classes I missed?"
SNEAKERS = ("I THINK NIKE IS THE BETTER BRAND FOR A SNEAKER, BECAUSE EACH SNEAKER IS LIGHT. A PRADA SNEAKER IS "
            "PRETTY, BUT A NIKE SNEAKER IS MADE FOR SPORT. MY SNEAKER, YOUR SNEAKER, HIS SNEAKER AND HER SNEAKER: ALL "
            "NIKE. THE LAST SNEAKER I BOUGHT WAS ALSO A NIKE SNEAKER.\nP.S. I STILL LIKE THE PRADA SNEAKER.")
SHOUTED = "NIKE MAKES THE BETTER SNEAKER. EVERY RUNNER I KNOW WEARS A NIKE SNEAKER, AND " + "SNEAKER " * 9 + "FOREVER."
# (key, completion, hand-checked (strict, loose) per instruction or None): written for the checks' edges; each is
# also compared with lm-eval's scoring below
CASES = [
    (1001, "Day one we sail to Tokyo. Day two we walk in Kyoto and rest.", ([True], [True])),
    (1001, "Day one, we sail to Tokyo.", ([False], [False])),
    (1019, LOWER, ([True], [True])),
    (1019, "Sure!\n" + LOWER, ([False], [True])),  # loose only: without its first line
    (1040, '"MATTHIAS ALGIERS is a SKILLED welder with years of experience in building bridges."',
     ([True, True, True], [True, True, True])),
    (1040, 'Here is the resume:\n"Matthias Algiers is a skilled welder."', ([True, False, False], [True, False, True])),
    (1174, "Hi *there*. It is *sunny* in Lima.", ([True, True, True], [True, True, True])),
    (1174, "One. Two. Three. Four. Five. Six. Seven.", ([True, False, False], [True, False, False])),  # 7 sentences
    # Punkt's English model counts 6 sentences (not 8: "Mr." and "Dr." end none), and 6 is not fewer than 6
    (1174, "Mr. Smith says it is *sunny*. Dr. Lee agrees *today*. He is right. It is. So. Yes.",
     ([True, False, True], [True, False, True])),
    (1127, SECTIONS + MONEY, ([True, True], [True, True])),
    (1127, SECTIONS + f"**{MONEY}**", ([True, False], [True, True])),  # loose only: without the '*'
    (1075, '{"product": "CloudSoft diaper", "claim": "comfy"}', ([True], [True])),
    (1075, 'Here is the ad:\n```json\n{"product": "CloudSoft diaper"}\n```', ([False], [True])),
    (1098, "Allah\n******\nYahweh", ([True], [True])),
    (1098, "Allah", ([False], [False])),
    (1219, SNEAKERS, ([True, True, True], [True, True, True])),
    (1219, SHOUTED, ([False, False, True], [False, False, True])),  # langdetect (seeded) calls this German
    (1012, REPEAT + "\n<<I Quit>>\nDear boss, I am leaving.", ([True, True], [True, True])),
    (1012, "<<I Quit>>\nDear boss, I am leaving.", ([False, True], [False, True])),
    (1092, "Japan was lovely.", ([True], [True])),
    (1092, "word " * 300, ([False], [False])),
    (9001, "* Der Herbst ist meine liebste Jahreszeit, weil die Blätter so bunt sind.\n* Im Herbst trinke ich "
           "gern warmen Tee am Fenster und lese ein Buch.", ([True, True], [True, True])),
    (9001, "* Autumn is my favourite season because the leaves turn red.\n* I like tea by the window.",
     ([False, True], [False, True])),
    (9002, "Rain falls softly on the roofs.\n\nHowever, the garden loves it.", ([True, True], [True, True])),
    (9002, "Rain makes everything wet.\n\nThe umbrella helps.", ([False, False], [False, False])),
    (9002, "", ([False, False], [False, False])),  # an empty completion follows nothing
]


@pytest.fixture(scope="module")
def rows() -> dict[int, dict]:
    return {row["key"]: row for row in map(json.loads, (DATA / "train.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def problems():
    return {json.loads(p.answer)["key"]: p for p in ifeval.load_problems(str(DATA), "train", on_bad_row="error")}


def lm_eval_scores(row: dict, text: str):
    """lm-eval's own strict and loose results of a published row (None-valued kwargs and all), as its
    process_results builds them."""
    utils = ifeval_checks.lm_eval_ifeval()[0]
    example = utils.InputExample(key=row["key"], instruction_id_list=row["instruction_id_list"],
                                 prompt=row["prompt"], kwargs=row["kwargs"])
    return (utils.test_instruction_following_strict(example, text).follow_instruction_list,
            utils.test_instruction_following_loose(example, text).follow_instruction_list)


def test_the_shipped_punkt_model_is_nltk_datas_and_the_sentence_checks_use_it():
    readme = (ROOT / "common" / "tasks" / "nltk_data" / "README.md").read_text()
    table = dict(re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \|$", readme, re.M))
    assert len(table) == 5
    for name, digest in table.items():
        assert hashlib.sha256((ifeval_checks.NLTK_DATA / name).read_bytes()).hexdigest() == digest, name
    ifeval_checks.lm_eval_ifeval()
    import nltk
    from lm_eval.tasks.ifeval import instructions_util

    nltk.data.find("tokenizers/punkt_tab/english/")  # found, so lm-eval did not try to download it
    # the English model knows these abbreviations: an untrained Punkt would count four sentences
    assert instructions_util.count_sentences("Mr. Smith went to Washington. He met Dr. Jones there.") == 2
    assert nltk.word_tokenize("NOT AT ALL. Fine.") == ["NOT", "AT", "ALL", ".", "Fine", "."]


@pytest.mark.parametrize("key, text, expected", CASES, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(CASES)])
def test_rewards_equal_lm_evals_scoring(rows, problems, key, text, expected):
    strict, loose = lm_eval_scores(rows[key], text)
    if expected is not None:
        assert (strict, loose) == (expected[0], expected[1])
    reference = problems[key].answer
    assert ifeval_checks.followed(text, reference) == (tuple(strict), tuple(loose))
    assert REWARDS["ifeval_strict"](text, reference) == sum(strict) / len(strict)
    assert REWARDS["ifeval_loose"](text, reference) == sum(loose) / len(loose)
    total, parts = RewardSet({"ifeval_strict": 1.0, "ifeval_loose": 0.0}).score(text, reference)
    assert total == parts["ifeval_strict"] and parts["answer_correct"] == 0.0 and "ifeval_loose" in parts


def test_the_cases_cover_every_instruction_of_the_data_and_loose_only_passes(rows):
    covered = {i for key, _, _ in CASES for i in rows[key]["instruction_id_list"]}
    assert covered == {i for row in rows.values() for i in row["instruction_id_list"]} and len(covered) >= 20
    loose_only = [k for k, _, e in CASES if e and any(lo and not st for st, lo in zip(*e))]
    assert len(loose_only) >= 4


def test_the_four_metrics_are_lm_evals_aggregation(rows, problems):
    utils, _, mean = ifeval_checks.lm_eval_ifeval()
    docs = [utils.process_results(rows[key], [text]) for key, text, _ in CASES]
    want = {name: (mean if name.startswith("prompt") else utils.agg_inst_level_acc)([d[name] for d in docs])
            for name in ifeval_checks.METRICS}
    got = ifeval_checks.metrics([problems[key].answer for key, _, _ in CASES], [text for _, text, _ in CASES])
    assert got == want and list(got) == list(ifeval_checks.METRICS)
    assert 0 < got["prompt_level_strict_acc"] < got["prompt_level_loose_acc"] < 1


def test_the_metrics_through_the_reward_worker_are_the_same_and_bounded_by_its_deadline(problems):
    """A run's evaluation scores the checks in the reward worker: the same four figures; a completion on which
    lm-eval's postscript pattern is quadratic (a long whitespace run) follows nothing at the deadline instead of
    holding the trainer."""
    from grpo_stream.common.tasks.reward_workers import RewardWorker  # noqa: PLC0415 - this test's subject

    references, texts = [problems[key].answer for key, _, _ in CASES], [text for _, text, _ in CASES]
    worker = RewardWorker(ifeval.IfevalTask.eval_rewards, deadline_s=30.0)
    try:
        assert ifeval_checks.metrics(references, texts, worker.call) == ifeval_checks.metrics(references, texts)
        postscript = next(key for key, row in problems.items() if "postscript" in row.answer)
        worker.deadline_s = 0.5
        start = time.monotonic()
        slow = "Fine." + " " * 200_000 + "x"  # lm-eval's pattern takes minutes on this in-process
        got = ifeval_checks.metrics([problems[postscript].answer], [slow], worker.call)
        assert time.monotonic() - start < 15 and got["inst_level_strict_acc"] == 0.0
        assert worker.overruns["ifeval_strict"] == 1
    finally:
        worker.close()


def test_a_check_that_raises_is_an_instruction_not_followed_logged_once(problems, monkeypatch, caplog):
    registry = ifeval_checks.lm_eval_ifeval()[1].INSTRUCTION_DICT

    class Broken(registry["startend:quotation"]):
        def check_following(self, value):
            raise IndexError("boom")

    monkeypatch.setitem(registry, "startend:quotation", Broken)
    monkeypatch.setattr(ifeval_checks, "_warned", set())
    reference = problems[1040].answer
    with caplog.at_level(logging.WARNING, "grpo_stream.common.tasks.ifeval_checks"):
        for text in ('"ALL FINE here."', '"ALL FINE there."'):
            assert ifeval_checks.followed(text, reference) == ((True, True, False), (True, True, False))
    assert len([r for r in caplog.records if "startend:quotation raised IndexError: boom" in r.message]) == 1


@pytest.mark.parametrize("instruction, kwargs, text", [
    ("keywords:frequency", {"relation": "at least", "keyword": "story ", "frequency": 2}, "A story, and another story."),
    ("detectable_format:multiple_sections", {"section_spliter": "SECTION ", "num_sections": 2},
     "SECTION 1\nfoo\nSECTION 2\nbar"),
    ("detectable_content:postscript", {"postscript_marker": "P.S. "}, "Hello.\n\nP.S. bye"),
    ("detectable_content:postscript", {"postscript_marker": " P.P.S"}, "Hello.\n\nP.P.S bye"),
])
def test_arguments_lm_eval_strips_score_as_lm_eval_scores_them(instruction, kwargs, text):
    """An argument with a space around it (lm-eval strips it before building its pattern) scores as lm-eval's own
    check of the same row: escaped before the strip, `story ` became `story\\` (a pattern that fails)."""
    utils = ifeval_checks.lm_eval_ifeval()[0]
    example = utils.InputExample(key=1, instruction_id_list=[instruction], prompt="p", kwargs=[kwargs])
    official = utils.test_instruction_following_strict(example, text).follow_instruction_list[0]
    assert official  # each text follows its instruction
    reference = ifeval_checks.make_reference(1, "p", [instruction], [kwargs])
    assert ifeval_checks.ifeval_strict(text, reference) == 1.0


def test_a_reference_that_is_not_an_ifeval_prompts_scores_zero():
    for reference in ("4", "", "not json", '{"prompt": "p", "instruction_id_list": [], "kwargs": []}'):
        assert ifeval_checks.ifeval_strict("anything", reference) == ifeval_checks.ifeval_loose("x", reference) == 0.0


def test_loading_the_published_format(rows, problems, tmp_path):
    assert len(problems) == len(rows) == 12
    loaded = ifeval.load_problems(str(DATA / "train.jsonl"), "train", limit=3)  # one file, as well as a directory
    assert [p.prompt_id for p in loaded] == ["train/0", "train/1", "train/2"]
    assert loaded[0].question == rows[1001]["prompt"]
    reference = json.loads(problems[1174].answer)  # the Hub copy's null arguments are dropped, the rest kept
    assert reference["kwargs"][1] == {"relation": "less than", "num_sentences": 6}
    assert reference["instruction_id_list"] == rows[1174]["instruction_id_list"] and reference["key"] == 1174
    keyless = tmp_path / "train.jsonl"
    keyless.write_text(json.dumps({k: v for k, v in rows[1001].items() if k != "key"}) + "\n")
    assert json.loads(ifeval.load_problems(str(tmp_path), "train")[0].answer)["key"] is None


BAD_ROWS = [
    ("not json", "not valid JSON"),
    ("[1, 2]", "expected an object in google/IFEval's format"),
    ({"prompt": " ", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]},
     "missing or empty field 'prompt'"),
    ({"prompt": "p", "instruction_id_list": [], "kwargs": []}, "field 'instruction_id_list': give a non-empty"),
    ({"prompt": "p", "instruction_id_list": ["punctuation:no_comma"], "kwargs": []},
     "field 'kwargs': give a list of one object per instruction (1)"),
    ({"prompt": "p", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}], "key": "k"}, "field 'key'"),
    ({"prompt": "p", "instruction_id_list": ["punctuation:no_commas"], "kwargs": [{}]},
     "field 'instruction_id_list'[0]: 'punctuation:no_commas' is not one of lm-eval's IFEval instructions"),
    ({"prompt": "p", "instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 5}]},
     "field 'kwargs'[0] of 'length_constraints:number_words' lacks ['relation']"),
    ({"prompt": "p", "instruction_id_list": ["length_constraints:number_words"],
      "kwargs": [{"num_words": 5, "relation": "about"}]}, "field 'kwargs'[0] of 'length_constraints:number_words'"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS, ids=range(len(BAD_ROWS)))
def test_a_bad_row_is_named_with_its_line_and_field(tmp_path, caplog, rows, row, message):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(rows[1092]) + "\n" + (row if isinstance(row, str) else json.dumps(row)) + "\n")
    with pytest.raises(DatasetError, match=re.escape(f"{path}:2: {message}")) as err:
        ifeval.load_problems(str(tmp_path), "train", on_bad_row="error")
    assert "dataset.on_bad_row=skip" in str(err.value)
    with caplog.at_level(logging.WARNING):
        assert [p.prompt_id for p in ifeval.load_problems(str(tmp_path), "train")] == ["train/0"]
    assert f"{path}:2: {message}" in caplog.text


def ifeval_cfg(*overrides):
    return load_config(None, ["task.name=ifeval", f"task.dataset.source={DATA}", "task.dataset.test_split=train",
                              "warmstart.steps=0", "model.tiny.vocab_size=512", *overrides])


def test_the_task_shards_the_prompts_and_evaluates_on_them(rows):
    task, tokenizer = ifeval.build(ifeval_cfg(), None)
    shards = [task.train_stream(i, 3) for i in range(3)]
    drawn = [[next(s) for _ in range(4)] for s in shards]  # one pass over each shard of 4
    ids = [p.prompt_id for shard in drawn for p in shard]
    assert sorted(ids) == sorted(f"train/{i}" for i in range(12))  # disjoint, and together the split
    again = [next(task.train_stream(1, 3, start=k)).prompt_id for k in range(4)]  # a restart resumes the order
    assert again == [p.prompt_id for p in drawn[1]]
    assert [p.prompt_id for p in task.heldout(5)] == [f"train/{i}" for i in range(5)]
    assert task.split_problems("test", 2) == task.split_problems("train", 2) == task.heldout(2)
    assert task.heldout(1)[0].prompt == tokenizer.bos_text + rows[1001]["prompt"]  # 'plain': the prompt as it is
    assert task.render_question("Say hi without commas.") == "Say hi without commas."
    metrics = task.eval_metrics(task.heldout(2), ["No commas here", "what is this?"])
    assert set(metrics) == set(ifeval_checks.METRICS)


def test_prompt_templates_and_a_missing_test_split():
    with pytest.raises(ValueError, match="task.prompt_template='reasoning': the ifeval task takes 'chat'"):
        ifeval.build(ifeval_cfg("task.prompt_template=reasoning"), None)
    task, _ = ifeval.build(ifeval_cfg("task.prompt_template=chat"), None)
    with pytest.raises(ValueError, match="no chat template"):  # the tiny tokenizer has none: says so
        task.heldout(1)
    with pytest.raises(DatasetError, match="no test.jsonl .* set task.dataset.test_split=train"):
        ifeval.build(ifeval_cfg("task.dataset.test_split=test"), None)


class FakeChatTokenizer:
    bos_text = "<bos>"
    has_chat_template = True

    def render_chat(self, messages, add_generation_prompt, tools=None):
        assert add_generation_prompt and tools is None
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


def test_chat_renders_the_prompt_as_the_user_turn():
    render = ifeval.renderer("chat", FakeChatTokenizer())
    assert render("Write a haiku.") == "<user>Write a haiku.</user><assistant>"
    assert ifeval.renderer("plain", FakeChatTokenizer())("Write a haiku.") == "<bos>Write a haiku."


def test_the_trainer_reports_each_reward_component():
    from grpo_stream.trainer_service.reports.step_report import component_means

    @dataclasses.dataclass
    class Completion:
        reward_components: dict

    @dataclasses.dataclass
    class Group:
        completions: list

    groups = [Group([Completion({"ifeval_strict": 1.0, "ifeval_loose": 1.0}), Completion({"ifeval_strict": 0.0,
                                                                                          "ifeval_loose": 0.5})])]
    assert component_means(groups) == {"reward/ifeval_loose": 0.75, "reward/ifeval_strict": 0.5}


@pytest.mark.parametrize("instruction, kwargs", [
    ("keywords:existence", {"keywords": ["(?:[\\s\\S]*){200}\x00"]}),
    ("keywords:forbidden_words", {"forbidden_words": ["(a|aa)*$"]}),
    ("keywords:frequency", {"keyword": "(a+)+$", "frequency": 1, "relation": "at least"}),
    ("detectable_format:multiple_sections", {"section_spliter": "(a|a)*b", "num_sections": 2}),
    ("detectable_content:postscript", {"postscript_marker": "(x+x+)+y"}),
])
def test_arguments_lm_eval_puts_into_regular_expressions_match_as_text(instruction, kwargs):
    """A dataset row's or a client's argument is matched as the text it is: a pattern that would backtrack for
    minutes (what froze samplers) is scored at once, and the text itself is still found."""
    reference = ifeval_checks.make_reference(None, "p", [instruction], [kwargs])
    text = "a" * 40 + "!" + " " + "x" * 30
    started = time.monotonic()
    ifeval_checks.ifeval_strict(text, reference)
    assert time.monotonic() - started < 5  # unescaped: minutes (the nested quantifiers on 40 a's)
    if instruction != "keywords:forbidden_words":  # lm-eval wraps those in \\b, which punctuation never meets
        value = next(v for k, v in kwargs.items() if k not in ("frequency", "relation", "num_sections"))
        literal = value[0] if isinstance(value, list) else value
        assert ifeval_checks.followed(f"{literal} {literal}\n{literal} 1 x {literal} 2 y", reference)[0] == (True,)


def test_submit_refuses_a_reference_the_checks_cannot_read():
    good = ifeval_checks.make_reference(None, "p", ["punctuation:no_comma"], [{}])
    assert ifeval_checks.reference_problem(good) is None
    for reference, field in (("{", "reference_answer: not JSON"), ("4", "give an object"),
                             ('{"prompt": 1}', "string 'prompt'"),
                             ('{"prompt": "p", "instruction_id_list": [], "kwargs": []}', "instruction_id_list"),
                             ('{"prompt": "p", "instruction_id_list": ["a:b"], "kwargs": [{}]}',
                              "'a:b' is not one of lm-eval's IFEval instructions")):
        assert field in ifeval_checks.reference_problem(reference)


def test_a_value_lm_eval_replaces_with_a_random_draw_is_refused(rows):
    """google/IFEval's row 1122 asks for 4 '#': lm-eval takes only a-z for `letter` and counts a random letter at
    every check instead, so one completion scored 0 or 1 by chance; such a row is refused, its field named. Values
    lm-eval keeps (an upper-case letter, every row of the data) still pass."""
    hashtags = {"let_relation": "at least", "letter": "#", "let_frequency": 4}
    text = "#a #b #c #d " + "abcdefghijklm " * 4  # half the alphabet 4 times: half the random letters pass
    utils = ifeval_checks.lm_eval_ifeval()[0]
    example = utils.InputExample(key=1122, instruction_id_list=["keywords:letter_frequency"], prompt="p",
                                 kwargs=[hashtags])
    assert {utils.test_instruction_following_strict(example, text).follow_all_instructions
            for _ in range(60)} == {True, False}  # lm-eval's own scoring of the row: a coin toss
    for kwargs, field in ((hashtags, "['letter']"), ({"relation": "at least", "num_words": -5}, "['num_words']")):
        instruction = "keywords:letter_frequency" if "letter" in kwargs else "length_constraints:number_words"
        why = ifeval_checks.instructions_problem([instruction], [kwargs])
        assert why.startswith(f"field 'kwargs'[0] of '{instruction}': lm-eval does not take the value of {field}")
    assert ifeval_checks.instructions_problem(["keywords:letter_frequency"], [{**hashtags, "letter": "T"}]) is None
    assert all(ifeval_checks.instructions_problem(r["instruction_id_list"], r["kwargs"]) is None for r in rows.values())


@pytest.mark.parametrize("instruction, kwargs, error", [
    ("language:response_language", {"language": "xx"}, "KeyError"),
    ("keywords:frequency", {"keyword": 5, "frequency": 2, "relation": "at least"}, "keyword=5 is not a string"),
    ("length_constraints:nth_paragraph_first_word", {"first_word": 3, "num_paragraphs": 2, "nth_paragraph": 1},
     "first_word=3 is not a string"),
])
def test_arguments_on_which_lm_eval_raises_are_a_named_problem_not_a_crash(instruction, kwargs, error):
    """lm-eval's build raises KeyError on an unknown language code and AttributeError on a number where it wants
    text: a dataset row or a submitted reference with them is refused with its field named, instead of the load or
    the Submit handler raising."""
    why = ifeval_checks.reference_problem(ifeval_checks.make_reference(None, "p", [instruction], [kwargs]))
    assert why.startswith(f"reference_answer: field 'kwargs'[0] of '{instruction}': {error}")


@pytest.mark.parametrize("instruction, kwargs, message", [
    ("keywords:existence", {"keywords": "ocean"}, "keywords='ocean' is not a list of strings"),
    ("keywords:forbidden_words", {"forbidden_words": "bad"}, "forbidden_words='bad' is not a list of strings"),
    ("detectable_content:postscript", {"postscript_marker": 5}, "postscript_marker=5 is not a string"),
    ("startend:end_checker", {"end_phrase": ["Done."]}, "end_phrase=['Done.'] is not a string"),
    ("combination:repeat_prompt", {"prompt_to_repeat": ["p"]}, "prompt_to_repeat=['p'] is not a string"),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2.5}, "num_highlights=2.5 is not a whole"),
    ("length_constraints:number_words", {"num_words": "100", "relation": "at least"}, "num_words='100' is not a"),
])
def test_arguments_of_the_wrong_type_are_refused_by_name(instruction, kwargs, message):
    """lm-eval checks no argument's type: a keyword list given as one string is sorted into its letters, each then a
    keyword ('ocean' passed on any text with o, c, e, a and n), and a number where it strips text raises at every
    check, so every completion scored 0 on a row that was taken. Such a row is refused, its field named."""
    why = ifeval_checks.instructions_problem([instruction], [kwargs])
    assert why is not None and why.startswith(f"field 'kwargs'[0] of '{instruction}': {message}")


def test_every_argument_of_lm_evals_instructions_has_a_type():
    """The type tables cover every argument lm-eval's instructions take (a new one would go unchecked)."""
    registry = ifeval_checks.lm_eval_ifeval()[1].INSTRUCTION_DICT
    typed = {*ifeval_checks.COUNT_ARGUMENTS, *ifeval_checks.WORD_LIST_ARGUMENTS, *ifeval_checks.TEXT_ARGUMENTS}
    taken = {k for iid, cls in registry.items() for k in cls(iid).get_instruction_args_keys()}
    assert taken <= typed, taken - typed
