"""Dataset files a user may hand in that the JSONL/Parquet readers once let out as a traceback or a hub lookup."""

import json

import pytest

from grpo_stream.common.tasks.gsm8k import DatasetError, load_problems

GOOD = json.dumps({"question": "How many?", "answer": "Two. #### 2"})


def test_a_line_nested_too_deeply_is_a_bad_row_named_by_its_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(GOOD + "\n" + "[" * 100_000 + "]" * 100_000 + "\n" + GOOD + "\n")
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: not valid JSON \(nested too deeply"):
        load_problems(str(path), "train", on_bad_row="error")
    assert [p.prompt_id for p in load_problems(str(path), "train")] == ["train/0", "train/2"]


@pytest.mark.parametrize("name", ["train.json", "train.csv", "data"])
def test_a_local_file_of_another_format_is_refused_not_looked_up_on_the_hub(tmp_path, monkeypatch, name):
    (tmp_path / name).write_text(GOOD + "\n")
    monkeypatch.chdir(tmp_path)  # a relative source, as a config names one: once taken for a hub dataset name
    with pytest.raises(DatasetError, match=rf"dataset.source={name} is a .* file: .*\.jsonl.*\.parquet"):
        load_problems(name, "train")


def test_a_file_that_is_not_parquet_is_a_dataset_error_naming_it(tmp_path):
    path = tmp_path / "train.parquet"
    path.write_text(GOOD + "\n")
    with pytest.raises(DatasetError, match=r"train\.parquet is not a readable Parquet file"):
        load_problems(str(path), "train")
    with pytest.raises(DatasetError, match=r"not a readable Parquet file"):
        load_problems(str(tmp_path), "train")  # the directory form reads the same file


def test_a_source_neither_local_nor_on_the_hub_is_a_dataset_error_naming_where_it_was_looked_for(tmp_path,
                                                                                                   monkeypatch):
    datasets = pytest.importorskip("datasets")
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    for module, name in ((datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"),
                         (hub_constants, "HF_HUB_OFFLINE")):
        monkeypatch.setattr(module, name, True)  # the real library, answering at once instead of retrying for 30 s
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError, match=rf"dataset.source=gsm8k_data: not a local file or directory \(from "
                                           rf"{tmp_path}\), and the Hugging Face hub gave no split train"):
        load_problems("gsm8k_data", "train")  # a mistyped relative directory


def test_a_lone_surrogate_escape_is_a_bad_row_named_by_its_line(tmp_path, caplog):
    """A JSON line may escape half of a UTF-16 pair (`\\ud83d` without its `\\ude00`: an emoji cut by a tool that
    truncated its text). It parsed into a string no UTF-8 encoder takes, and was loaded: the tiny model's tokenizer
    training, or a checkpoint tokenizer's encode when a sampler reached the row (again at every restart, its
    data position resumed there), raised naming no file or line. It is one bad row, as an undecodable byte is; a
    whole pair (`\\ud83d\\ude00`, one emoji) is text."""
    path = tmp_path / "train.jsonl"
    emoji = json.dumps({"question": "How many \U0001f600?", "answer": "#### 1"})  # ensure_ascii: a whole pair
    assert "\\ud83d\\ude00" in emoji
    path.write_text("\n".join([GOOD, '{"question": "How many \\ud83d apples?", "answer": "#### 3"}',
                               '{"question": "q", "answer": "Four \\udc00 #### 4"}', emoji]) + "\n")
    problems = load_problems(str(path), "train")
    assert [p.prompt_id for p in problems] == ["train/0", "train/3"]
    assert problems[1].question == "How many \U0001f600?"
    assert all(p.question.encode() and p.solution.encode() for p in problems)
    assert f"{path}:2: not valid JSON (not UTF-8: a lone surrogate escape" in caplog.text
    assert f"{path}:3: not valid JSON (not UTF-8: a lone surrogate escape" in caplog.text
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: .*lone surrogate"):
        load_problems(str(path), "train", on_bad_row="error")


def test_a_parquet_row_not_utf8_is_a_bad_row_named_by_its_row(tmp_path, caplog):
    """A Parquet string column need not hold UTF-8 (writers that do not check it): its rows were decoded all at
    once, and one bad row stopped the load with a UnicodeDecodeError naming neither the file nor the row (and
    on_bad_row=skip could not skip it). It is one bad row, named as a JSON line is."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    questions = pa.array([b"How many?", b"How many \xff apples?", b"And now?"], type=pa.binary()).view(pa.string())
    answers = pa.array(["#### 2", "#### 3", "#### 4"])
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": questions, "answer": answers}), path)
    problems = load_problems(str(tmp_path), "train")
    assert [(p.prompt_id, p.answer) for p in problems] == [("train/0", "2"), ("train/2", "4")]
    assert f"{path} row 2: not valid JSON" not in caplog.text  # not JSON: said as what it is
    assert f"{path} row 2: not UTF-8" in caplog.text
    with pytest.raises(DatasetError, match=r"train\.parquet row 2: not UTF-8"):
        load_problems(str(path), "train", on_bad_row="error")
