"""IFEval (google/IFEval) as a task: instruction-following prompts whose rewards are lm-eval's verifiable checks.

Data: a local copy of google/IFEval in its published format, JSON lines of
`{"key": 1000, "prompt": "...", "instruction_id_list": ["punctuation:no_comma", ...], "kwargs": [{...}, ...]}`,
one kwargs object per instruction (the Hub's copy fills each with every argument name, most of them null: nulls
are dropped, as lm-eval does). task.dataset.source is a directory with `train.jsonl` (or `.parquet`) or one such
file; google/IFEval has only the `train` split (541 prompts), so evaluation uses it too (task.dataset.test_split:
train). Rows are read by gsm8k.load_rows, so sources, bad rows (`on_bad_row`, each named with its file and line)
and `limit` behave as for GSM8K; a row is bad when a field is missing or mistyped, or when lm-eval could not check
its instructions as given (ifeval_checks.instructions_problem).

Prompts: an IFEval prompt is a user's request, so task.prompt_template is 'chat' (the prompt as the user turn of
the tokenizer's chat template) or 'plain' (the prompt text as it is, after the tokenizer's BOS text). A problem's
reference answer is the JSON the checks read (ifeval_checks.make_reference); rewards `ifeval_strict` and
`ifeval_loose` score against it, and `grpo-stream eval` reports lm-eval's four IFEval figures (`eval_metrics`).
"""

from __future__ import annotations

import dataclasses
import functools

from grpo_stream.common.tasks import ifeval_checks, prompts
from grpo_stream.common.tasks.gsm8k import DatasetError, Gsm8kTask, load_rows
from grpo_stream.common.tasks.task_tokenizer import build_tokenizer_on


@dataclasses.dataclass(frozen=True)
class IfevalProblem:
    prompt_id: str   # "<split>/<row index>", as for GSM8K: stable across runs and processes
    question: str    # the prompt as the dataset gives it
    answer: str      # the reference the checks read: ifeval_checks.make_reference


FORMAT = "google/IFEval's format: 'prompt', 'instruction_id_list' and 'kwargs'"


def _problem(row, split: str, index: int):
    """(IfevalProblem, None) of a dataset row, or (None, why it is refused: the field and the fix)."""
    if not isinstance(row, dict):  # (a line that is no row never comes here: load_rows refuses it)
        return None, f"expected an object in {FORMAT}, got {type(row).__name__}"
    prompt, ids, kwargs, key = (row.get(f) for f in ("prompt", "instruction_id_list", "kwargs", "key"))
    if not isinstance(prompt, str) or not prompt.strip():
        return None, "missing or empty field 'prompt' (the request to the model)"
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        return None, ("field 'instruction_id_list': give a non-empty list of lm-eval instruction ids, e.g. "
                      "[\"punctuation:no_comma\"]")
    if not isinstance(kwargs, list) or len(kwargs) != len(ids) or not all(isinstance(k, dict) for k in kwargs):
        return None, (f"field 'kwargs': give a list of one object per instruction ({len(ids)}), {{}} for an "
                      "instruction without arguments")
    if key is not None and (not isinstance(key, int) or isinstance(key, bool)):
        return None, f"field 'key': an integer id (google/IFEval's) or none, got {key!r}"
    why = ifeval_checks.instructions_problem(ids, kwargs)
    if why:
        return None, why
    return IfevalProblem(f"{split}/{index}", prompt, ifeval_checks.make_reference(key, prompt, ids, kwargs)), None


def load_problems(source: str, split: str, on_bad_row="skip", hub_config: str | None = None,
                  limit: int | None = None) -> list[IfevalProblem]:
    """The prompts of one split, in file order (up to `limit`)."""
    return load_rows(source, split, lambda row, index: _problem(row, split, index), on_bad_row, hub_config, limit)


class IfevalTask(Gsm8kTask):
    """The samplers' shards, held-out and named splits as for GSM8K (Gsm8kTask), of IFEval prompts; `eval_metrics`
    gives `grpo-stream eval` lm-eval's four IFEval figures."""

    eval_rewards = ("ifeval_strict", "ifeval_loose")  # what eval_metrics asks `call` for (the reward worker's names)

    def eval_metrics(self, problems: list, completions: list[str], call=None) -> dict[str, float]:
        """prompt_level_strict_acc, inst_level_strict_acc, prompt_level_loose_acc, inst_level_loose_acc of the
        completions of `problems`, aggregated as lm-eval does; `call`: how each check runs (ifeval_checks.metrics)."""
        return ifeval_checks.metrics([p.answer for p in problems], completions, call)


def renderer(template: str, tokenizer, system: str | None = None):
    """How a prompt becomes the text the model continues (task.prompt_template; `system`: task.system_prompt)."""
    if template == "plain":
        return lambda prompt: tokenizer.bos_text + prompt
    if template == "chat":
        return lambda prompt: prompts.render(prompt, "chat", tokenizer, system=system)
    raise ValueError(f"task.prompt_template={template!r}: the ifeval task takes 'chat' (the prompt as the user turn "
                     "of the tokenizer's chat template) or 'plain' (the prompt text as it is)")


def build(cfg, hf_tokenizer):
    """The task registry's entry (task.name=ifeval): prompts from task.dataset, rendered with task.prompt_template
    and the tokenizer (the checkpoint's, or a BPE trained on the training prompts)."""
    d = cfg.task.dataset
    load = functools.partial(load_problems, d.source, on_bad_row=d.on_bad_row, hub_config=d.hub_config,
                             limit=d.limit)
    train = load(d.train_split)
    try:
        test = train if d.test_split == d.train_split else load(d.test_split)
    except DatasetError as exc:
        raise DatasetError(f"{exc} (google/IFEval has one split, train: set task.dataset.test_split=train to "
                           "evaluate on it)") from exc
    tokenizer = hf_tokenizer or build_tokenizer_on([p.question for p in train], cfg)
    render = renderer(cfg.task.prompt_template, tokenizer, cfg.task.system_prompt)
    return IfevalTask(train, test, render, cfg.run.seed, (d.train_split, d.test_split)), tokenizer
