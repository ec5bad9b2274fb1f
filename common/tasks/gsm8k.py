"""GSM8K-style datasets: question/answer rows from JSONL, Parquet or a Hugging Face `datasets` name.

A row needs a question and a reference solution ending in `#### N` (GSM8K's
format; the field names are configurable). Bad rows (missing field, not an
object, no final answer) are either skipped, each reported once with its file
and line, or rejected with the same message (`on_bad_row`). Splits are files:
`SOURCE/{split}.jsonl` or `.parquet` for a directory, or the split of a
`datasets` name (`openai/gsm8k`, config `main`); the network is used only
by that last source.

`shard(index, count)` gives sampler `index` of `count` every count-th problem,
so samplers never draw the same prompt and together cover the split.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import re
from typing import Iterable, Literal

from grpo_stream.common.tasks import prompts
from grpo_stream.common.tasks.answers import parse_number, reference_answer
from grpo_stream.common.tasks.streams import shuffled_shard
from grpo_stream.common.tasks.task_tokenizer import build_tokenizer_on
from grpo_stream.common.tools.calculator import math_tools, sandbox_limits

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MathProblem:
    prompt_id: str        # "<split>/<row index>": stable across runs and processes
    question: str
    answer: str           # the final answer, e.g. "72"
    solution: str         # the full reference solution


class DatasetError(ValueError):
    pass


class UnreadableRow(ValueError):
    """A row of a source that holds no row (a line that is not JSON, text that is not UTF-8): a bad row, said as what
    its message says."""


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # `\ud83d`: where a JSON line may escape half a UTF-16 pair


def _rows_jsonl(path: pathlib.Path) -> Iterable[tuple[str, object]]:
    """(place, row or the exception that made the line no row) per non-blank line. A leading UTF-8 BOM (what Windows
    editors write) is not part of the first row, and a line that is not UTF-8 is one bad row, named by its line:
    decoding the file strictly stopped the whole load at it with a UnicodeDecodeError naming neither. So is a line
    escaping half of a UTF-16 pair (`\\ud83d` alone): it parsed into a string no UTF-8 encoder takes, which the
    tokenizer's training, or a sampler's encode when it reached the row, raised on, naming neither."""
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                line.encode("utf-8")  # fails only where a byte did not decode (surrogateescape kept it)
                row = json.loads(line)
                lone = _lone_surrogate(row) if _SURROGATE_ESCAPE.search(line) else None
                yield where, row if lone is None else ValueError(
                    f"not UTF-8: a lone surrogate escape {lone}, half of a UTF-16 pair (text cut inside a character)")
            except UnicodeEncodeError as exc:
                yield where, ValueError(f"not UTF-8: an undecodable byte at column {exc.start + 1}")
            except json.JSONDecodeError as exc:
                yield where, exc
            except RecursionError:  # json.loads recurses per nesting level: a line of 100k '[' raised out of the load
                yield where, ValueError("nested too deeply to parse")


def _lone_surrogate(row) -> str | None:
    """The first lone surrogate in a parsed row's text, written as its escape (`\\ud83d`), or None."""
    try:
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"\\u{ord(exc.object[exc.start]):04x}"
    return None


def _rows_parquet(path: pathlib.Path) -> Iterable[tuple[str, object]]:
    """(place, row) per row. A string column need not hold UTF-8 (its writer may not check): decoded all at once, one
    such row stopped the load with a UnicodeDecodeError naming neither file nor row; then each row is decoded alone,
    and one that is not UTF-8 is a bad row naming its field."""
    import pyarrow.parquet as pq  # noqa: PLC0415 - deferred: only for Parquet sources

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError: a file that is not Parquet
        raise DatasetError(f"dataset.source: {path} is not a readable Parquet file ({exc})") from exc
    try:
        rows = table.to_pylist()
    except UnicodeDecodeError:
        rows = (_parquet_row(table, i) for i in range(table.num_rows))
    for number, row in enumerate(rows, 1):
        yield f"{path} row {number}", row


def _parquet_row(table, i: int) -> dict | UnreadableRow:
    row = {}
    for name in table.column_names:
        try:
            row[name] = table.column(name)[i].as_py()
        except UnicodeDecodeError as exc:
            return UnreadableRow(f"not UTF-8: field '{name}' has an undecodable byte at position {exc.start + 1}")
    return row


def _rows_hub(name: str, config: str | None, split: str) -> Iterable[tuple[str, object]]:
    import datasets  # noqa: PLC0415 - deferred: only for hub sources; may download

    try:
        rows = datasets.load_dataset(name, config, split=split)
    except (OSError, ValueError) as exc:  # ConnectionError, DatasetNotFoundError, an unknown split
        raise DatasetError(f"dataset.source={name}: not a local file or directory (from {pathlib.Path.cwd()}), and "
                           f"the Hugging Face hub gave no split {split} of it: {exc}") from exc
    for number, row in enumerate(rows, 1):
        yield f"{name}[{split}] row {number}", row


def _source_rows(source: str, split: str, hub_config: str | None) -> Iterable[tuple[str, object]]:
    path = pathlib.Path(source)
    if path.is_dir():
        for suffix, reader in ((".jsonl", _rows_jsonl), (".parquet", _rows_parquet)):
            candidate = path / f"{split}{suffix}"
            if candidate.exists():
                return reader(candidate)
        raise DatasetError(f"dataset.source={source}: no {split}.jsonl or {split}.parquet in that directory")
    if path.suffix == ".jsonl" and path.exists():
        return _rows_jsonl(path)
    if path.suffix == ".parquet" and path.exists():
        return _rows_parquet(path)
    if path.suffix in (".jsonl", ".parquet") or source.startswith((".", "/")):
        raise DatasetError(f"dataset.source={source}: no such file or directory")
    if path.exists():  # a local file of another format was taken for a hub name: retries, then 'Couldn't reach'
        raise DatasetError(f"dataset.source={source} is a {path.suffix or 'suffix-less'} file: a file source must be "
                           "JSON Lines (.jsonl) or Parquet (.parquet)")
    return _rows_hub(source, hub_config, split)


def load_problems(source: str, split: str, question_field: str = "question", answer_field: str = "answer",
                  on_bad_row: Literal["skip", "error"] = "skip", hub_config: str | None = "main",
                  limit: int | None = None) -> list[MathProblem]:
    """The problems of one split, in file order (up to `limit`)."""
    return load_rows(source, split, lambda row, index: _problem(row, split, index, question_field, answer_field),
                     on_bad_row, hub_config, limit)


def load_rows(source: str, split: str, parse, on_bad_row: Literal["skip", "error"] = "skip",
              hub_config: str | None = "main", limit: int | None = None) -> list:
    """The items `parse(row, index) -> (item, None) | (None, why)` makes of one split's rows, in file order (up to
    `limit`); a row it refuses is skipped and logged with its place, or stops the load (`on_bad_row`). Every dataset
    task reads its rows through here, so sources, bad rows and limits behave the same for all of them."""
    problems: list = []
    skipped = 0
    for index, (where, row) in enumerate(_source_rows(source, split, hub_config)):
        if limit is not None and len(problems) >= limit:
            break
        problem, why = (None, _unreadable(row)) if isinstance(row, Exception) else parse(row, index)
        if problem is not None:
            problems.append(problem)
            continue
        message = f"{where}: {why}"
        if on_bad_row == "error":
            raise DatasetError(message + " (set dataset.on_bad_row=skip to skip such rows)")
        log.warning("skipping %s", message)
        skipped += 1
    if not problems:
        raise DatasetError(f"dataset.source={source} split {split}: no usable problems ({skipped} rows skipped)")
    if skipped:
        log.warning("%s[%s]: %d rows skipped, %d problems loaded", source, split, skipped, len(problems))
    return problems


def _unreadable(row: Exception) -> str:
    """Why a source's row is no row: an UnreadableRow says it; the JSON reader's errors are the line's JSON."""
    return str(row) if isinstance(row, UnreadableRow) else f"not valid JSON ({row})"


def _problem(row, split: str, index: int, question_field: str, answer_field: str):
    if not isinstance(row, dict):
        return None, f"expected an object with '{question_field}' and '{answer_field}', got {type(row).__name__}"
    for setting, field in (("question_field", question_field), ("answer_field", answer_field)):
        value = row.get(field)
        if value is not None and not isinstance(value, str):
            return None, (f"field '{field}' is not text but {type(value).__name__} (the field dataset.{setting} names; "
                          "a reference solution is text ending in '#### <answer>')")
        if value is None or not value.strip():
            return None, f"missing or empty field '{field}' (the field dataset.{setting} names)"
    try:
        answer = reference_answer(row[answer_field])
    except ValueError as exc:
        return None, f"field '{answer_field}': {exc}"
    if parse_number(answer) is None:  # cut: the message is logged, and a row's text may be any length
        shown = repr(answer[:64]) + (f" ({len(answer)} characters)" if len(answer) > 64 else "")
        return None, f"field '{answer_field}': final answer {shown} is not a number"
    return MathProblem(f"{split}/{index}", row[question_field].strip(), answer, row[answer_field]), ""


def shard(problems: list, index: int, count: int) -> list:
    """Every `count`-th problem starting at `index`: sampler `index` of `count`."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} not in [0, {count})")
    return problems[index::count]


@dataclasses.dataclass(frozen=True)
class PromptedProblem:
    """What samplers and evaluation need of a problem: id, the rendered prompt, the reference answer."""
    prompt_id: str
    prompt: str
    answer: str


class Gsm8kTask:
    """Prompts from a train split (each sampler its own shard, reshuffled every epoch), evaluation on a test split."""

    def __init__(self, train: list[MathProblem], test: list[MathProblem], render, seed: int,
                 splits: tuple[str, str] = ("train", "test")):
        """`splits`: the dataset's names of the train and test splits (task.dataset)."""
        self.train, self.test, self.render, self.seed = train, test, render, seed
        self.splits = splits

    def split_problems(self, split: str, limit: int) -> list[PromptedProblem]:
        """The first `limit` problems of `split` (`grpo-stream eval --split`; 'train' and 'test' name them too)."""
        train_split, test_split = self.splits
        if split in (test_split, "test"):
            return self.heldout(limit)
        if split in (train_split, "train"):
            return [self._prompted(p) for p in self.train[:limit]]
        raise ValueError(f"--split {split}: this config's splits are {train_split} and {test_split}")

    def render_question(self, question: str) -> str:
        """A bare question wrapped as the run's prompts are (for injected prompts)."""
        return self.render(question)

    def _prompted(self, problem: MathProblem) -> PromptedProblem:
        return PromptedProblem(problem.prompt_id, self.render(problem.question), problem.answer)

    def train_stream(self, index: int, count: int, start: int = 0):
        """Sampler `index` of `count`: its shard, reshuffled every pass, from position `start` on (a restarted
        sampler resumes where its accepted groups end)."""
        if not self.train[index::count]:
            raise DatasetError(f"sampler {index} of sampler.replicas={count} has no training problems: the split has "
                               f"{len(self.train)} (task.dataset.limit?)")
        return (self._prompted(p) for p in shuffled_shard(self.train, index, count, self.seed, start, "task.dataset"))

    def heldout(self, n: int) -> list[PromptedProblem]:
        return [self._prompted(p) for p in self.test[:n]]


def _check_splits_apart(d) -> None:
    """A source that is one file has no splits: every split read from it is all its rows. Evaluating on a test split
    read from it would score the problems the samplers train on, so two split names over one file are refused; the
    same name twice (test_split equal to train_split) asks for that knowingly."""
    path = pathlib.Path(d.source)
    if path.suffix in (".jsonl", ".parquet") and path.is_file() and d.train_split != d.test_split:
        raise DatasetError(f"task.dataset.source={d.source} is one file, so the train split ({d.train_split}) and the "
                           f"test split ({d.test_split}) would both be all its rows and evaluation would score "
                           f"training problems: give a directory with {d.train_split}.jsonl and {d.test_split}.jsonl, "
                           f"or set task.dataset.test_split={d.train_split} to evaluate on the training problems")


def build(cfg, hf_tokenizer):
    """The task registry's entry (task.name=gsm8k): problems from task.dataset, prompts rendered with
    task.prompt_template and the tokenizer (the checkpoint's, or a BPE trained on the training problems)."""
    d = cfg.task.dataset
    _check_splits_apart(d)
    train, test = (load_problems(d.source, split, d.question_field, d.answer_field, d.on_bad_row, d.hub_config,
                                 d.limit) for split in (d.train_split, d.test_split))
    tokenizer = hf_tokenizer or build_tokenizer_on([f"{p.question} {p.solution}" for p in train], cfg)
    # the environment's tools (environment.name=gsm8k_tools), listed by the chat template
    tools = math_tools(sandbox_limits(cfg)).schemas() if cfg.task.prompt_template == "tools" else None
    return Gsm8kTask(train, test, prompts.renderer(cfg, tokenizer, tools), cfg.run.seed,
                     (d.train_split, d.test_split)), tokenizer
