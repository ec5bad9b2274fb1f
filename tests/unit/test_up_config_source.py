"""The config file `up` was given, as every process it starts reads it: a private copy in the run directory
(grpo_stream/up/config_record.py: snapshot_config), so an edit, a move or a deletion of the file at --config while
the run goes on reaches no process that `up` restarts (a sampler restarted after a kill -9 read the edited file: a
key that file did not know yet stopped the whole run as a config error, a changed setting ran in that one process)."""

from __future__ import annotations

import stat

from grpo_stream.common.config.loading import load_config
from grpo_stream.up.config_record import SOURCE_FILE
from grpo_stream.up.run import _prepare, device_plan
from grpo_stream.up.run_lock import RunLock


def planned(tmp_path, config, overrides):
    run_dir = tmp_path / "run"
    lock = RunLock.acquire(run_dir, "test")
    try:
        cfg = load_config(config, overrides)
        return run_dir, _prepare(cfg, config, overrides, run_dir, device_plan(cfg, run_dir), None, lock)
    finally:
        lock.release()


def config_of(spec) -> str:
    return spec.argv[spec.argv.index("--config") + 1]


def test_every_process_reads_a_private_copy_of_the_config_that_later_edits_do_not_reach(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("generation:\n  temperature: 0.7\nhardware:\n  trainer_env:\n    WANDB_API_KEY: key-123\n")
    run_dir, specs = planned(tmp_path, config, ["trainer.steps=3"])
    copies = {config_of(spec) for spec in specs}
    assert copies == {str(run_dir / SOURCE_FILE)} and len(specs) == 3  # the trainer and both samplers
    config.write_text("generation:\n  temperature: 1.3\n  a_key_of_a_later_version: 1\n")  # edited mid-run
    restarted = load_config(config_of(specs[1]), ["trainer.steps=3"])  # what a restarted sampler loads
    assert restarted.generation.temperature == 0.7
    assert restarted.hardware.trainer_env == {"WANDB_API_KEY": "key-123"}
    config.unlink()  # moved or deleted mid-run
    assert load_config(config_of(specs[0]), []).generation.temperature == 0.7
    assert stat.S_IMODE((run_dir / SOURCE_FILE).stat().st_mode) == 0o600  # it may hold secrets, as the file may


def test_a_resume_copies_the_config_it_is_given_now(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("generation:\n  temperature: 0.7\n")
    planned(tmp_path, config, [])
    config.write_text("generation:\n  temperature: 0.9\n")  # `up` started again with an edited config
    _, specs = planned(tmp_path, config, [])
    assert load_config(config_of(specs[0]), []).generation.temperature == 0.9


def test_without_a_config_file_no_copy_is_made(tmp_path):
    run_dir, specs = planned(tmp_path, None, [])
    assert all("--config" not in spec.argv for spec in specs) and not (run_dir / SOURCE_FILE).exists()
