"""`grpo-stream eval --json PATH`: a PATH that cannot take the result is refused before anything is evaluated (it ran
the whole evaluation, then failed to write it with `[Errno 21] Is a directory`, and the figures were lost)."""

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.runtime.errors import SetupError
from grpo_stream.reports.evaluate import run_eval
from tests.conftest import CONFIGS


@pytest.fixture
def cfg(monkeypatch):
    def evaluated(*_args, **_kwargs):
        raise AssertionError("the evaluation ran before --json was checked")

    monkeypatch.setattr("grpo_stream.common.assembly.parts.build_task_and_tokenizer", evaluated)
    return load_config(CONFIGS / "tiny_arith.yaml", [])


def test_a_json_path_that_is_a_directory_is_refused_before_evaluating(cfg, tmp_path):
    with pytest.raises(SetupError, match=r"--json .*is a directory; name a file, e.g. .*eval\.json"):
        run_eval(cfg, "test", 1, tmp_path)


def test_a_json_path_under_a_file_is_refused_before_evaluating(cfg, tmp_path):
    (tmp_path / "taken").write_text("x")
    with pytest.raises(SetupError, match=r"--json .*its folder cannot be made"):
        run_eval(cfg, "test", 1, tmp_path / "taken" / "eval.json")
