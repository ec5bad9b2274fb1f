"""GSM8K loading on the real data (../shared/data/gsm8k), other sources, bad rows and sharding."""

import json
import random

import pytest

from grpo_stream.common.tasks.answers import same_number
from grpo_stream.common.tasks.rewards import answer_correct
from grpo_stream.common.tasks.gsm8k import DatasetError, load_problems, shard



@pytest.fixture(scope="module")
def splits(gsm8k_dir):
    return {split: load_problems(str(gsm8k_dir), split, on_bad_row="error") for split in ("train", "test")}


def test_every_reference_solution_scores_one(splits):
    assert len(splits["train"]) == 7473 and len(splits["test"]) == 1319
    for problems in splits.values():
        assert all(answer_correct(p.solution, p.answer) == 1.0 for p in problems)


def test_a_reference_scores_zero_against_another_problem_unless_the_numbers_match(splits):
    problems = splits["test"]
    rng = random.Random()
    order = list(range(len(problems)))
    rng.shuffle(order)
    matched = 0
    for i, j in zip(range(len(problems)), order):
        if i == j:
            continue
        want = 1.0 if same_number(problems[i].answer, problems[j].answer) else 0.0
        matched += want
        assert answer_correct(problems[i].solution, problems[j].answer) == want
    assert matched < len(problems) / 10  # most pairs differ, so the zero case is really exercised


def test_sources_jsonl_file_parquet_and_split_dir(tmp_path, splits, gsm8k_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": p.question, "answer": p.solution} for p in splits["test"][:20]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    from_parquet = load_problems(str(tmp_path), "test")
    from_file = load_problems(str(gsm8k_dir / "test.jsonl"), "test", limit=20)
    assert [p.answer for p in from_parquet] == [p.answer for p in from_file] == [p.answer for p in splits["test"][:20]]
    assert from_file[3].prompt_id == "test/3"


def test_bad_rows_are_reported_with_their_line_and_skipped_or_rejected(tmp_path, caplog):
    path = tmp_path / "train.jsonl"
    good = {"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}
    path.write_text("\n".join([json.dumps(good), json.dumps({"question": "no answer field"}), "{not json",
                               json.dumps({"question": "q", "answer": "no final"}), json.dumps(good)]) + "\n")
    problems = load_problems(str(path), "train", on_bad_row="skip")
    assert [p.prompt_id for p in problems] == ["train/0", "train/4"]
    text = caplog.text
    assert f"{path}:2: missing or empty field 'answer'" in text and "dataset.answer_field" in text
    assert f"{path}:3: not valid JSON" in text and f"{path}:4: field 'answer'" in text
    with pytest.raises(DatasetError, match=f"{path}:2: missing or empty field 'answer'.*on_bad_row=skip"):
        load_problems(str(path), "train", on_bad_row="error")


def test_custom_field_names_and_missing_sources(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"problem": "2 + 2?", "solution": "#### 4"}) + "\n")
    assert load_problems(str(path), "train", question_field="problem", answer_field="solution")[0].answer == "4"
    with pytest.raises(DatasetError, match="no usable problems"):
        load_problems(str(path), "train")
    with pytest.raises(DatasetError, match="dataset.source=.*no such file"):
        load_problems(str(tmp_path / "missing.jsonl"), "train")
    with pytest.raises(DatasetError, match="no validation.jsonl or validation.parquet"):
        load_problems(str(tmp_path), "validation")


def test_shards_partition_a_split(splits):
    problems = splits["test"]
    parts = [shard(problems, i, 3) for i in range(3)]
    ids = [p.prompt_id for part in parts for p in part]
    assert len(ids) == len(set(ids)) == len(problems)
    with pytest.raises(ValueError, match="shard index 3"):
        shard(problems, 3, 3)


def test_a_sampler_without_problems_is_an_error_naming_the_settings(splits):
    from grpo_stream.common.tasks.gsm8k import Gsm8kTask

    task = Gsm8kTask(splits["train"][:2], splits["test"][:2], lambda q: q, seed=0)
    assert next(task.train_stream(1, 4)).prompt_id == "train/1"
    with pytest.raises(DatasetError, match=r"sampler 3 of sampler.replicas=4 has no training problems"):
        next(task.train_stream(3, 4))


def test_a_stream_started_at_a_position_continues_the_uninterrupted_one(splits):
    """Across reshuffled passes: stream(start=k) is the uninterrupted stream from item k on (sampler resume)."""
    from grpo_stream.common.tasks.gsm8k import Gsm8kTask

    task = Gsm8kTask(splits["train"][:10], splits["test"][:2], lambda q: q, seed=4)
    whole = [p.prompt_id for p, _ in zip(task.train_stream(0, 2), range(17))]  # a shard of 5: three passes+
    for start in (0, 3, 5, 11):
        assert [p.prompt_id for p, _ in zip(task.train_stream(0, 2, start), range(17 - start))] == whole[start:]


def test_a_row_not_utf8_a_bom_and_a_non_text_answer_are_rows_named_by_line(tmp_path, caplog):
    """A line that is not UTF-8 stopped the whole load with a UnicodeDecodeError naming no file or line (and
    on_bad_row=skip could not skip it); a BOM made the first row invalid JSON; an answer given as a number was
    reported as 'missing or empty'; a huge final answer was quoted whole in the log."""
    good = json.dumps({"question": "1 + 1?", "answer": "1 + 1 = 2\n#### 2"}).encode()
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + good + b'\n{"question": "caf\xe9?", "answer": "#### 3"}\n' +
                     json.dumps({"question": "q", "answer": 18}).encode() + b"\n" +
                     json.dumps({"question": "q", "answer": "#### " + "x" * 5000}).encode() + b"\n" + good + b"\n")
    problems = load_problems(str(path), "train", on_bad_row="skip")
    assert [p.prompt_id for p in problems] == ["train/0", "train/4"]
    assert f"{path}:2: not valid JSON (not UTF-8: an undecodable byte at column 18)" in caplog.text
    assert f"{path}:3: field 'answer' is not text but int (the field dataset.answer_field names" in caplog.text
    assert f"{path}:4: field 'answer': final answer '{'x' * 64}' (5000 characters) is not a number" in caplog.text
    with pytest.raises(DatasetError, match=f"{path}:2: not valid JSON .*on_bad_row=skip"):
        load_problems(str(path), "train", on_bad_row="error")


def test_one_file_is_not_read_as_both_the_train_and_the_test_split(tmp_path):
    """A single-file source was read whole for each split: every held-out problem was a training problem, and the
    evaluation scored what the samplers train on without a word. Two split names over one file are refused, naming
    the fix; the same name twice evaluates on the training problems, as asked."""
    from grpo_stream.common.config.loading import load_config
    from grpo_stream.common.tasks import gsm8k

    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(6)))
    overrides = ["task.name=gsm8k", f"task.dataset.source={path}", "warmstart.steps=0"]
    with pytest.raises(DatasetError, match=r"is one file.*directory with train.jsonl and test.jsonl.*"
                                           r"task.dataset.test_split=train"):
        gsm8k.build(load_config(None, overrides), None)
    task, _ = gsm8k.build(load_config(None, overrides + ["task.dataset.test_split=train"]), None)
    assert [p.prompt_id for p in task.heldout(6)] == [f"train/{i}" for i in range(6)]
    (tmp_path / "train.jsonl").write_text(path.read_text())
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "What is 9 + 9?", "answer": "#### 18"}) + "\n")
    task, _ = gsm8k.build(load_config(None, overrides[:1] + [f"task.dataset.source={tmp_path}", "warmstart.steps=0"]),
                          None)
    assert [p.prompt_id for p in task.heldout(6)] == ["test/0"]
