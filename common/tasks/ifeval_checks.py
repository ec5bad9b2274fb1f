"""IFEval's verifiable instruction checks as rewards and metrics, scored by lm-eval's own IFEval code.

The checks are lm-eval's (`lm_eval.tasks.ifeval`: Google's instruction-following checks, as `lm_eval --tasks
ifeval` scores them), called rather than copied, so a reward is what lm-eval would score. Each instruction of a
prompt is checked on its own through lm-eval's `test_instruction_following_strict` / `_loose`: a check that raises
on some completion (a bug of a check, a strange text) counts that instruction as not followed and is logged once,
instead of failing the sampler's whole batch.

Rewards (task.rewards):
- ifeval_strict: the share of the prompt's instructions the completion follows as it is (lm-eval's strict test).
- ifeval_loose: the same with lm-eval's loose test (a completion passes if one of its variants without the first
  line, the last line or the `*` marks passes), so >= ifeval_strict.
The share, not all-or-nothing: a prompt has 1-3 instructions, and following two of three is worth more than one,
which a group's advantages can only see with a graded reward (the prompt-level figure is in `metrics`).

Offline: lm-eval's instructions_util downloads nltk's `punkt_tab` model when it is missing; this module puts the
English model that grpo-stream ships (`nltk_data/`, its README says where it comes from) at the end of nltk's search
path before importing lm-eval, so nothing is downloaded. langdetect, which the language checks use, is seeded (0):
unseeded, as lm-eval leaves it, a short or mixed text may get a different language, so a different reward, on two
calls.
"""

from __future__ import annotations

import functools
import json
import logging
import pathlib
import random
import re

from grpo_stream.common.tasks.base import THINK_END, reply

log = logging.getLogger(__name__)

NLTK_DATA = pathlib.Path(__file__).resolve().parent / "nltk_data"
METRICS = ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc")
_warned: set[str] = set()
# lm-eval pastes these arguments into regular expressions; a dataset row or an injected prompt chose them, so a
# pattern that backtracks for minutes could freeze whoever scores it. Escaped before every check: a word, a phrase or
# a marker matches as the text it is (google/IFEval's values are plain text, so their scores are unchanged).
REGEX_ARGUMENTS = ("keywords", "forbidden_words", "keyword", "section_spliter", "postscript_marker", "starter")
STRIPPED_ARGUMENTS = ("keyword", "section_spliter", "postscript_marker", "starter")  # lm-eval strips these
LM_EVAL_MARKERS = ("P.S.", "P.P.S")  # postscript markers lm-eval matches with its own patterns: left as they are
DRAW_SEEDS = (0, 1, 2, 3, 4, 5, 6, 7)  # an instruction built under each: an argument lm-eval drew at random differs
# The type of each argument of google/IFEval (the one lm-eval draws when none is given). lm-eval checks none: a keyword
# list given as one string is sorted into its letters, each then a keyword, and a number or list where it strips
# text raises at every check, so every completion scored 0 on it while the row was taken.
COUNT_ARGUMENTS = ("num_sentences", "num_placeholders", "num_bullets", "num_highlights", "num_sections",
                   "num_paragraphs", "nth_paragraph", "num_words", "frequency", "let_frequency", "capital_frequency")
WORD_LIST_ARGUMENTS = ("keywords", "forbidden_words")
TEXT_ARGUMENTS = ("language", "relation", "let_relation", "capital_relation", "section_spliter", "postscript_marker",
                  "keyword", "letter", "first_word", "end_phrase", "prompt_to_repeat")


class IfevalUnavailable(RuntimeError):
    """lm-eval's IFEval code, or a package it needs, is not installed."""


@functools.cache
def lm_eval_ifeval():
    """lm-eval's IFEval modules `(utils, instructions_registry, mean)`, imported once (about a second: lm-eval's
    task package comes with it), after nltk can find the shipped Punkt model."""
    try:
        import langdetect  # noqa: PLC0415 - deferred: the `ifeval` extra, about a second
        import nltk  # noqa: PLC0415 - deferred: as above

        if str(NLTK_DATA) not in nltk.data.path:
            nltk.data.path.append(str(NLTK_DATA))
        langdetect.DetectorFactory.seed = 0
        from lm_eval.api.metrics import mean  # noqa: PLC0415 - deferred: as above
        from lm_eval.tasks.ifeval import instructions_registry, utils  # noqa: PLC0415 - deferred: as above
    except ImportError as exc:
        raise IfevalUnavailable(f"the ifeval task needs lm-eval's IFEval checks ({exc}); install them with "
                                "pip install 'grpo-stream[ifeval]' (or -e '.[ifeval]' in a checkout)") from exc
    return utils, instructions_registry, mean


def make_reference(key: int | None, prompt: str, instruction_ids: list[str], kwargs: list[dict]) -> str:
    """The reference answer of an IFEval prompt: compact JSON of what the checks read (google/IFEval's fields),
    kwargs without their None values (lm-eval drops them too). Samplers score with it; it travels as the answer."""
    doc = {"key": key, "prompt": prompt, "instruction_id_list": instruction_ids,
           "kwargs": [{k: v for k, v in kw.items() if v is not None} for kw in kwargs]}
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))


def _warn_once(what: str, message: str, *args) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(message, *args)


@functools.lru_cache(maxsize=4096)
def _example(reference: str):
    """lm-eval's InputExample of a reference (make_reference), None when it is not one."""
    try:
        doc = json.loads(reference)
    except ValueError:
        return None
    if not (isinstance(doc, dict) and isinstance(doc.get("prompt"), str)
            and isinstance(doc.get("instruction_id_list"), list) and isinstance(doc.get("kwargs"), list)
            and len(doc["instruction_id_list"]) == len(doc["kwargs"]) > 0):
        return None
    if not all(isinstance(kwargs, dict) for kwargs in doc["kwargs"]):
        return None
    utils = lm_eval_ifeval()[0]
    return utils.InputExample(key=doc.get("key"), instruction_id_list=doc["instruction_id_list"],
                              prompt=doc["prompt"], kwargs=[literal_arguments(kw) for kw in doc["kwargs"]])


def literal_arguments(kwargs: dict) -> dict:
    """An instruction's arguments with those lm-eval puts into regular expressions (REGEX_ARGUMENTS) escaped; those
    lm-eval strips first (STRIPPED_ARGUMENTS) are stripped before, or an escaped trailing space would leave a lone
    backslash in its pattern (`story ` -> `story\\ ` -> `story\\`)."""
    def literal(name, value):
        if name in STRIPPED_ARGUMENTS and isinstance(value, str):
            value = value.strip()
        if name == "postscript_marker" and value in LM_EVAL_MARKERS:
            return value
        if isinstance(value, str):
            return re.escape(value)
        if isinstance(value, list):
            return [re.escape(v) if isinstance(v, str) else v for v in value]
        return value

    return {k: literal(k, v) if k in REGEX_ARGUMENTS else v for k, v in kwargs.items()}


def reference_problem(reference: str) -> str | None:
    """Why `reference` is not an IFEval prompt's reference (make_reference's JSON of google/IFEval's fields) whose
    instructions lm-eval can check, naming the field; None when it is one. What `Submit` asks of an injected
    prompt scored by an IFEval reward."""
    try:
        doc = json.loads(reference)
    except ValueError as exc:
        return f"reference_answer: not JSON ({exc}); an IFEval reward reads make_reference's JSON of " \
               "'prompt', 'instruction_id_list' and 'kwargs'"
    if not isinstance(doc, dict) or not isinstance(doc.get("prompt"), str):
        return "reference_answer: give an object with a string 'prompt'"
    ids, kwargs = doc.get("instruction_id_list"), doc.get("kwargs")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        return "reference_answer.instruction_id_list: give a non-empty list of lm-eval instruction ids"
    if not isinstance(kwargs, list) or len(kwargs) != len(ids) or not all(isinstance(k, dict) for k in kwargs):
        return f"reference_answer.kwargs: give a list of one object per instruction ({len(ids)})"
    why = instructions_problem(ids, kwargs)
    return f"reference_answer: {why}" if why else None


def _check(test, example, text: str) -> bool:
    """lm-eval's `test` of a one-instruction example; a check that raises is an instruction not followed."""
    try:
        return bool(test(example, text).follow_instruction_list[0])
    except Exception as exc:  # noqa: BLE001 - any failure of a check scores 0, never stops the batch
        instruction = example.instruction_id_list[0]
        _warn_once(instruction, "IFEval check %s raised %s: %s; scored as not followed (logged once per "
                   "instruction)", instruction, type(exc).__name__, exc)
        return False


@functools.lru_cache(maxsize=64)  # the rewards of one completion ask one after the other; texts may be long
def followed(text: str, reference: str) -> tuple[tuple[bool, ...], tuple[bool, ...]] | None:
    """(strict, loose): whether `text` follows each instruction of `reference`, by lm-eval's tests; None when the
    reference is not an IFEval one (cached: both rewards of a completion ask). A reasoning model's thinking is not
    checked: its reply is, as lm-eval takes it (think_end_token: the text after the last `</think>`, lstripped)."""
    if THINK_END in text:
        text = reply(text).lstrip()
    example = _example(reference)
    if example is None:
        _warn_once("reference", "an IFEval reward got a reference that is not an IFEval prompt's (%r...): scored 0; "
                   "the ifeval rewards go with task.name=ifeval", reference[:64])
        return None
    utils = lm_eval_ifeval()[0]
    strict, loose = [], []
    for instruction, kwargs in zip(example.instruction_id_list, example.kwargs):
        one = utils.InputExample(key=example.key, instruction_id_list=[instruction], prompt=example.prompt,
                                 kwargs=[kwargs])
        strict.append(_check(utils.test_instruction_following_strict, one, text))
        loose.append(_check(utils.test_instruction_following_loose, one, text))
    return tuple(strict), tuple(loose)


def ifeval_strict(text: str, reference: str) -> float:
    """Share of the prompt's instructions that `text` follows, by lm-eval's strict test."""
    got = followed(text, reference)
    return sum(got[0]) / len(got[0]) if got else 0.0


def ifeval_loose(text: str, reference: str) -> float:
    """Share of the prompt's instructions that `text` follows, by lm-eval's loose test."""
    got = followed(text, reference)
    return sum(got[1]) / len(got[1]) if got else 0.0


def doc_results(text: str, reference: str) -> dict:
    """One prompt's figures as lm-eval's `process_results` gives them (prompt-level bools, instruction-level lists)."""
    strict, loose = followed(text, reference) or ((False,), (False,))
    return {"prompt_level_strict_acc": all(strict), "inst_level_strict_acc": list(strict),
            "prompt_level_loose_acc": all(loose), "inst_level_loose_acc": list(loose)}


def metrics(references: list[str], completions: list[str], call=None) -> dict[str, float]:
    """IFEval's four figures over prompts, aggregated as lm-eval's ifeval.yaml does: the prompt-level ones with
    `mean`, the instruction-level ones with `agg_inst_level_acc` (over all instructions of all prompts).

    `call(name, fn, text, reference)`: how each check runs (the reward worker's `call`: lm-eval's checks read the
    model's text, and one of them is quadratic on whitespace runs, so a run's evaluation bounds them by
    task.reward_timeout_s; an overrun follows no instruction). The worker answers the share followed (ifeval_strict /
    ifeval_loose), which with the reference's instruction count gives each prompt's followed count exactly; here
    (call None) the checks run in this process."""
    utils, _, mean = lm_eval_ifeval()
    one = doc_results if call is None else functools.partial(_doc_results_through, call)
    per_doc = [one(text, ref) for text, ref in zip(completions, references, strict=True)]
    return {name: float((mean if name.startswith("prompt") else utils.agg_inst_level_acc)([d[name] for d in per_doc]))
            for name in METRICS}


def _doc_results_through(call, text: str, reference: str) -> dict:
    """doc_results with each check run by `call`: the followed count is the share times the instruction count (which
    of them were followed does not enter the figures); a reference that is not IFEval's is one instruction, not
    followed, as doc_results has it."""
    example = _example(reference)
    total = len(example.instruction_id_list) if example is not None else 1
    results = {}
    for how, fn in (("strict", ifeval_strict), ("loose", ifeval_loose)):
        share = call(fn.__name__, fn, text, reference) if example is not None else 0.0
        done = min(max(round(share * total), 0), total)
        followed_list = [True] * done + [False] * (total - done)
        results[f"prompt_level_{how}_acc"], results[f"inst_level_{how}_acc"] = all(followed_list), followed_list
    return results


def instructions_problem(instruction_ids: list[str], kwargs: list[dict]) -> str | None:
    """Why lm-eval could not check these instructions as a dataset row gives them, or None: an id it does not know,
    arguments its instruction refuses (its build raises), one missing, or one it replaces (a letter outside a-z, a
    negative count): lm-eval would draw a random value for those at every check, so a completion's reward would be
    noise."""
    registry = lm_eval_ifeval()[1].INSTRUCTION_DICT
    for i, (instruction_id, given) in enumerate(zip(instruction_ids, kwargs)):
        if instruction_id not in registry:
            return (f"field 'instruction_id_list'[{i}]: {instruction_id!r} is not one of lm-eval's IFEval "
                    f"instructions (e.g. {sorted(registry)[:3]})")
        used = {k: v for k, v in given.items() if v}  # lm-eval's own filter
        mistyped = _mistyped(used)
        if mistyped:
            return f"field 'kwargs'[{i}] of {instruction_id!r}: {mistyped}"
        try:
            keys = registry[instruction_id](instruction_id).get_instruction_args_keys()
            drawn = _drawn_at_random(registry[instruction_id], instruction_id, used)
        except Exception as exc:  # noqa: BLE001 - lm-eval's code on a row's or a client's values: any raise refuses
            return f"field 'kwargs'[{i}] of {instruction_id!r}: {type(exc).__name__}: {str(exc)[:200]}"
        missing = [k for k in keys if k not in used]
        if missing:
            return (f"field 'kwargs'[{i}] of {instruction_id!r} lacks {missing} (lm-eval would draw a random value "
                    "at every check); give them")
        if drawn:
            return (f"field 'kwargs'[{i}] of {instruction_id!r}: lm-eval does not take the value of {drawn} and "
                    "draws a random one at every check instead; give one it keeps (a letter a-z, a count >= 0)")
    return None


def _mistyped(arguments: dict) -> str | None:
    """What is wrong with the first argument not of its google/IFEval type (COUNT_ARGUMENTS...), or None."""
    for name, value in arguments.items():
        if name in COUNT_ARGUMENTS and (not isinstance(value, int) or isinstance(value, bool)):
            return f"{name}={value!r} is not a whole number"
        if name in WORD_LIST_ARGUMENTS and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return f"{name}={value!r} is not a list of strings (e.g. [\"ocean\"], not \"ocean\")"
        if name in TEXT_ARGUMENTS and not isinstance(value, str):
            return f"{name}={value!r} is not a string"
    return None


def _drawn_at_random(instruction_cls, instruction_id: str, used: dict) -> list[str]:
    """The arguments lm-eval draws at random for these values: the instruction, built once under each of
    DRAW_SEEDS, keeps a different value of them. Python's `random` state is put back after."""
    state = random.getstate()
    try:
        built = []
        for seed in DRAW_SEEDS:
            random.seed(seed)
            instruction = instruction_cls(instruction_id)
            instruction.build_description(**used)
            built.append(instruction.get_instruction_args() or {})
    finally:
        random.setstate(state)
    return sorted(k for k in built[0] if any(other.get(k) != built[0][k] for other in built[1:]))
