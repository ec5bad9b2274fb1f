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
