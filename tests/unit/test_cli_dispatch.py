"""The command line's one exit-code policy (grpo_stream/cli.py: dispatch): what a command raises becomes 2 (a config
or usage error), 3 (a permanent failure, recorded in RUN_DIR/failures for `up`), 130 (interrupted) or 1 (anything
else), in one place; and every command of the parser has its entry in the table."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import BaseModel

from grpo_stream import cli
from grpo_stream.commands import COMMANDS, Command, trainer_process_name
from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.runtime.errors import PermanentError, SetupError, read_permanent
from tests.conftest import CONFIGS


def raising(exc: BaseException):
    def run(_args, _cfg):
        raise exc
    return run


class Strict(BaseModel):
    steps: int


def validation_error() -> Exception:
    try:
        Strict.model_validate({"steps": "many"})
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        return exc
    raise AssertionError("validated")


@pytest.mark.parametrize("exc, code, what", [
    (ConfigError("trainer.steps: must be positive"), 2, "config error"),
    (validation_error(), 2, "config error"),
    (PermanentError("the checkpoint holds another model"), 3, "permanent error"),
    (RuntimeError("XLA: out of memory"), 1, "error"),
    (ValueError("a value the run met"), 1, "error"),  # not while loading the config: a runtime failure
    (KeyError("bug"), 1, "error"),
])
def test_one_policy_maps_what_a_command_raises(exc, code, what):
    assert cli.exit_code(exc, Command(raising(exc))) == (code, what)


def test_a_value_error_while_loading_the_config_is_a_config_error():
    assert cli.exit_code(ValueError("bad"), Command(raising(ValueError())), loading_config=True) == (2, "config error")


def test_a_run_that_cannot_be_built_is_permanent_under_up_and_a_usage_error_elsewhere():
    """A tokenizer without a pad token fails every restart the same way: a process `up` supervises exits 3 (up
    stops, naming it, instead of restarting every process into it); `eval` or `plan` given it exits 2."""
    exc = SetupError("model.pad_token: the tokenizer has no pad token; set model.pad_token=auto")
    assert cli.exit_code(exc, COMMANDS["sampler"]) == (3, "permanent error")
    assert cli.exit_code(exc, COMMANDS["eval"]) == (2, "error")


def test_building_a_runs_parts_raises_setup_errors(tmp_path):
    from grpo_stream.common.assembly.parts import build_task_and_tokenizer
    from grpo_stream.common.config.loading import load_config

    cfg = load_config(None, ["model.kind=hf", f"model.path={tmp_path}"])
    with pytest.raises(SetupError, match="model.path"):
        build_task_and_tokenizer(cfg)
    with pytest.raises(SetupError, match="task.prompt_template=chat: this tokenizer has no chat template"):
        build_task_and_tokenizer(load_config(None, ["task.prompt_template=chat", "warmstart.steps=0"]))


def test_a_commands_usage_errors_exit_2_and_others_1():
    command = Command(raising(FileNotFoundError()), usage_errors=(FileNotFoundError,))
    assert cli.exit_code(FileNotFoundError("no run.json"), command) == (2, "error")
    assert cli.exit_code(RuntimeError("redis"), command) == (1, "error")


def replace(monkeypatch, name: str, exc: BaseException) -> None:
    monkeypatch.setitem(COMMANDS, name, dataclasses.replace(COMMANDS[name], run=raising(exc)))


def test_a_permanent_failure_of_a_sampler_is_recorded_for_up_and_exits_3(tmp_path, monkeypatch, capsys):
    replace(monkeypatch, "sampler", PermanentError("sampler.model.path holds 2 layers; the trainer's has 4"))
    assert cli.main(["sampler", "--index", "2", "--run-dir", str(tmp_path), "sampler.replicas=3"]) == 3
    record = read_permanent(tmp_path, "sampler-2")
    assert record["error"] == "PermanentError" and record["message"].startswith("sampler.model.path holds 2 layers")
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("grpo-stream sampler: permanent error: sampler.model.path holds 2 layers")
    assert (tmp_path / "error-sampler.log").is_file()


@pytest.mark.parametrize("command, args, name", [
    ("ingest", ["--run-dir", "RUN"], "ingest"), ("trainer", ["--run-dir", "RUN"], "trainer-1")])
def test_the_ingest_and_each_trainer_process_record_under_their_own_name(tmp_path, monkeypatch, command, args, name):
    monkeypatch.setenv("JAX_PROCESS_ID", "1")
    replace(monkeypatch, command, PermanentError("refused"))
    assert cli.main([command, *[str(tmp_path) if a == "RUN" else a for a in args]]) == 3
    assert read_permanent(tmp_path, name)["message"] == "refused"


def test_a_command_not_run_by_up_records_nothing(tmp_path, monkeypatch):
    replace(monkeypatch, "report", PermanentError("refused"))
    assert cli.main(["report", str(tmp_path)]) == 3
    assert not (tmp_path / "failures").exists()


def test_interrupted_exits_130(monkeypatch, capsys):
    replace(monkeypatch, "devices", KeyboardInterrupt())
    assert cli.main(["devices"]) == 130
    assert capsys.readouterr().err.strip() == "grpo-stream devices: interrupted"


def test_a_bug_prints_its_traceback_as_well(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    replace(monkeypatch, "devices", KeyError("plan"))
    assert cli.main(["devices"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):" in err and err.strip().splitlines()[-1] == (
        "grpo-stream devices: error: 'plan'")


def test_a_config_error_exits_2_before_the_command_runs(monkeypatch, capsys):
    replace(monkeypatch, "trainer", AssertionError("ran"))
    assert cli.main(["trainer", "trainer.steps=0"]) == 2
    assert "grpo-stream trainer: config error: trainer.steps" in capsys.readouterr().err
    assert cli.main(["config", "describe", "nope"]) == 2
    assert capsys.readouterr().err.strip() == ("grpo-stream config: config error: no config field starts with 'nope'; "
                                               "`grpo-stream config describe` lists them all")


def test_print_config_stops_before_the_command(monkeypatch, capsys):
    replace(monkeypatch, "up", AssertionError("ran"))
    assert cli.main(["up", "--print-config", "trainer.steps=7"]) == 0
    assert "steps: 7" in capsys.readouterr().out


def test_overrides_may_follow_an_option_and_other_leftovers_are_refused(capsys):
    assert cli.main(["config", "show", "run.name=first", "--config", str(CONFIGS / "tiny_arith_smoke.yaml"),
                     "trainer.steps=5", "run.name=last"]) == 0
    shown = capsys.readouterr().out
    assert "  name: last\n" in shown and "  steps: 5\n" in shown  # in the order given
    with pytest.raises(SystemExit) as exited:
        cli.main(["config", "show", "--config", str(CONFIGS / "tiny_arith_smoke.yaml"), "--bogus"])
    assert exited.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_every_command_of_the_parser_has_an_entry():
    parser = cli._parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(commands) == set(COMMANDS)


def test_the_trainer_process_name_follows_its_jax_process_id(monkeypatch):
    monkeypatch.delenv("JAX_PROCESS_ID", raising=False)
    assert trainer_process_name() == "trainer-0"
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert trainer_process_name() == "trainer-3"


@pytest.mark.parametrize("args, message", [
    (["devices", "--gpus", "-1"], "argument --gpus: must be at least 0, got -1"),
    (["devices", "--gpus", "2", "--gpu-memory-gib", "-3"], "argument --gpu-memory-gib: must be a positive number"),
    (["devices", "--gpus", "2", "--gpu-memory-gib", "nan"], "argument --gpu-memory-gib: must be a positive number"),
    (["sampler", "--index", "-1"], "argument --index: must be at least 0, got -1"),
])
def test_a_negative_count_or_size_is_a_usage_error_naming_the_argument(args, message, capsys):
    """`devices --gpus -1` printed 'no GPU (CPU run)' and a negative --gpu-memory-gib was laid out as such, exit 0."""
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_sampler_index_past_the_replicas_is_a_config_error_before_jax_starts(capsys):
    """It exited 1 (a failure a restart may fix) after seconds of JAX start-up, its message saying '(1)' for 2
    replicas."""
    assert cli.main(["sampler", "--index", "2", "sampler.replicas=2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "grpo-stream sampler: config error: --index 2: a sampler's index is in 0..1 (sampler.replicas=2); give a "
        "smaller --index or raise sampler.replicas")


@pytest.mark.parametrize("args", [["up", "--run-dir", ""], ["trainer", "--run-dir", " "], ["audit", ""],
                                  ["up", "--config", ""], ["tokens", "--out", ""], ["submit", ""]])
def test_an_empty_path_is_refused_not_read_as_the_current_directory(args, monkeypatch, tmp_path, capsys):
    """`up --run-dir "$RUN_DIR"` with the variable unset ran the whole run in the current directory (pathlib reads ''
    as '.'), writing run.lock, redis/, checkpoints/ and logs/ among the user's files."""
    monkeypatch.chdir(tmp_path)
    replace(monkeypatch, args[0], AssertionError("ran"))
    with pytest.raises(SystemExit) as exited:
        cli.main(args)
    assert exited.value.code == 2 and "an empty path (an unset shell variable?)" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["up", "trainer", "sampler", "ingest", "colocated"])
@pytest.mark.parametrize("where", ["afile", "afile/run"])
def test_a_run_dir_where_a_file_stands_is_a_usage_error(command, where, monkeypatch, tmp_path, capsys):
    """`up --run-dir F` with F a file (or a path below one) failed after the config loaded with "cannot prepare the
    run in F: File exists" and exit 1, a failure a restart may fix: nothing ran, and nothing else would."""
    (tmp_path / "afile").write_text("notes")
    replace(monkeypatch, command, AssertionError("ran"))
    with pytest.raises(SystemExit) as exited:
        cli.main([command, "--run-dir", str(tmp_path / where)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "a file, not a directory; give a directory" in err, err
    assert (tmp_path / "afile").read_text() == "notes"
