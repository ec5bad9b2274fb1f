"""The command line's errors: one line for the user, and the whole traceback kept (the run's error log, or the
temporary directory's) and printed with --debug, so an XLA or device error is never reduced to one line alone."""

import pathlib

import pytest

from grpo_stream.cli import main


def test_an_expected_error_is_one_line_and_its_traceback_is_kept_in_the_run_dir(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2  # a directory without metrics: input it cannot use (exit 2)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-stream report: error: ") and "metrics-trainer.jsonl" in err[0]
    log = tmp_path / "error-report.log"
    assert f"(traceback in {log})" in err[0]
    assert log.read_text().startswith("Traceback (most recent call last):") and "FileNotFoundError" in log.read_text()


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_prints_the_traceback(tmp_path, capsys, where):
    args = ["audit", str(tmp_path / "missing")]
    assert main(["--debug", *args] if where == "before" else [*args, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):" in err and "in run_audit" in err
    assert err.strip().splitlines()[-1].startswith("grpo-stream audit: error: ")


def test_without_a_run_dir_the_traceback_goes_to_the_temporary_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert main(["audit", str(tmp_path / "missing")]) == 2
    assert "FileNotFoundError" in pathlib.Path(tmp_path, "grpo-stream-error-audit.log").read_text()


def test_a_config_error_stays_one_line_without_a_traceback_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert main(["config", "show", "trainer.stepz=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["grpo-stream config: config error: trainer.stepz: unknown key; did you mean trainer.steps? "
                   "(see --print-config for valid keys)"]
    assert not list(tmp_path.iterdir())


def test_a_multi_process_trainer_started_alone_says_how_to_join_the_others(tmp_path, capsys):
    """trainer.processes=2 without the distributed environment: one line naming the variables, before any wait; a
    permanent failure (exit 3), which `up` does not restart into the same wall."""
    assert main(["trainer", "--run-dir", str(tmp_path), "trainer.processes=2", "trainer.mesh.fsdp=2",
                 "distributed.initialize=never"]) == 3
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "trainer.processes=2, but this process is in a JAX job of 1 processes" in err
    assert "JAX_COORDINATOR_ADDRESS" in err and "JAX_PROCESS_ID" in err


def test_up_refuses_a_layout_the_gpus_cannot_hold_before_starting_anything(tmp_path, capsys):
    assert main(["up", "--run-dir", str(tmp_path), "hardware.gpus=2", "trainer.mesh.fsdp=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["grpo-stream up: error: trainer.mesh (fsdp x tp): the trainer's need 4 GPUs but this host shows 2 "
                   "(nvidia-smi, CUDA_VISIBLE_DEVICES or hardware.gpus); make the mesh smaller or use a host with 4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.lock"]  # no Redis, no logs: only the directory's lock


def test_every_command_takes_debug_after_it_config_actions_too(capsys):
    """The module doc says --debug works before or after the command; `config show --debug` and `config describe
    run --debug` were refused ("unrecognized arguments"), as only the top-level commands took it after them."""
    import argparse  # noqa: PLC0415 - this test only

    from grpo_stream.cli import _parser  # noqa: PLC0415

    def leaves(parser, name=""):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
        if not subs:
            yield name, parser
        for action in subs:
            for sub, child in action.choices.items():
                yield from leaves(child, f"{name} {sub}".strip())

    found = dict(leaves(_parser()))
    assert {"config show", "config describe", "up", "audit"} <= set(found)
    assert [name for name, p in found.items() if "--debug" not in p._option_string_actions] == []  # noqa: SLF001
    assert main(["config", "describe", "run.name", "--debug"]) == 0
    assert "run.name" in capsys.readouterr().out
