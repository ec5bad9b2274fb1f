"""RUN_DIR/config.yaml, the record of the config `up` resolved (grpo_stream/up/run.py: _prepare): readable by every
user of the host and attached to bug reports, so it keeps no value of a secret-named key, neither in the config nor
in the overrides its first line repeats."""

from __future__ import annotations

import yaml

from grpo_stream.common.config.loading import load_config
from grpo_stream.up.run import _prepare, device_plan, redacted_overrides
from grpo_stream.up.run_lock import RunLock


def prepared(tmp_path, config, overrides):
    """The run directory after `up`'s preparation (ports, tokens, the config record) of `config` and `overrides`."""
    run_dir = tmp_path / "run"
    lock = RunLock.acquire(run_dir, "test")
    try:
        cfg = load_config(config, overrides)
        _prepare(cfg, config, overrides, run_dir, device_plan(cfg, run_dir), None, lock)
    finally:
        lock.release()
    return run_dir


def test_the_config_record_keeps_no_secret_a_config_file_kept_private(tmp_path):
    config = tmp_path / "private.yaml"  # the user's, mode 0600: an API key its environments need
    config.write_text("hardware:\n  trainer_env:\n    WANDB_API_KEY: from-the-file-123\n")
    config.chmod(0o600)
    overrides = ["hardware.sampler_env.HF_TOKEN=from-the-command-456", "trainer.steps=3"]
    run_dir = prepared(tmp_path, config, overrides)
    text = (run_dir / "config.yaml").read_text()
    assert "from-the-file-123" not in text and "from-the-command-456" not in text
    record = yaml.safe_load(text)
    assert record["hardware"]["trainer_env"] == {"WANDB_API_KEY": "<redacted>"} and record["trainer"]["steps"] == 3
    assert "'hardware.sampler_env.HF_TOKEN=<redacted>', 'trainer.steps=3'" in text.splitlines()[0]


def test_only_the_values_of_secret_named_keys_are_hidden():
    assert redacted_overrides(["redis.auth.password_file=/run/pw", "sampler.vllm.engine_args.api_key=k",
                               "model.path=tokenizer", "flag"]) == [
        "redis.auth.password_file=/run/pw", "sampler.vllm.engine_args.api_key=<redacted>", "model.path=tokenizer",
        "flag"]


def test_a_secret_inside_a_mapping_override_is_hidden_in_the_record():
    """RUN_DIR/config.yaml's first line listed `task.verifiers.args={api_key: sk-1}` whole."""
    shown = redacted_overrides(["task.verifiers.args={api_key: sk-secret-1, n: 2}"])
    assert "sk-secret-1" not in shown[0] and "<redacted>" in shown[0] and '"n": 2' in shown[0]


def test_a_list_under_a_secret_named_key_is_hidden_item_by_item():
    """`api_keys=[k1, k2]` was recorded whole: only keys inside a list's mappings were looked at."""
    shown = redacted_overrides(["task.verifiers.args.api_keys=[sk-one, sk-two]"])
    assert "sk-one" not in shown[0] and "sk-two" not in shown[0] and shown[0].count("<redacted>") == 2


def test_up_warns_of_a_secret_given_on_the_command_line_without_repeating_it(tmp_path, capsys):
    """A secret given as an override sits on `up`'s command line and on each of its processes', where `ps` shows it to
    every user of the machine, with no word of it. `up` cannot hide its own command line: it names the keys (never the
    values) and says where a secret belongs."""
    overrides = ["task.verifiers.args={api_key: sk-secret-1}", "hardware.sampler_env.HF_TOKEN=hf-2", "trainer.steps=3"]
    prepared(tmp_path, None, overrides)
    said = capsys.readouterr().err
    assert "task.verifiers.args, hardware.sampler_env.HF_TOKEN given on the command line" in said
    assert "sk-secret-1" not in said and "hf-2" not in said and "trainer.steps" not in said and "mode 0600" in said


def test_a_resume_with_another_config_names_each_change_and_keeps_the_earlier_record(tmp_path, capsys):
    """`up` again on a run directory resumes it with whatever config it is given: another learning rate (a wrong
    --config, a forgotten override) went on silently, and RUN_DIR/config.yaml, the record of what the run trained with,
    was overwritten. The ports and Redis URL `up` picks afresh at each start are no change."""
    run_dir = prepared(tmp_path, None, ["trainer.steps=3", "trainer.learning_rate=0.001"])
    capsys.readouterr()
    prepared(tmp_path, None, ["trainer.steps=3", "trainer.learning_rate=0.001"])
    assert "differs" not in capsys.readouterr().err and not (run_dir / "config.yaml.1").exists()
    prepared(tmp_path, None, ["trainer.steps=5", "trainer.learning_rate=0.5"])
    said = capsys.readouterr().err
    assert "in 2 setting(s): trainer.learning_rate: 0.001 -> 0.5; trainer.steps: 3 -> 5." in said
    assert "config.yaml.1" in said and "port" not in said.split("setting(s)")[1]
    assert yaml.safe_load((run_dir / "config.yaml.1").read_text())["trainer"]["steps"] == 3
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["steps"] == 5


def test_a_record_cut_short_is_kept_and_said_not_an_error(tmp_path, capsys):
    """A config.yaml a kill left half-written must not stop the resume: it is kept aside and the resume says it could
    not compare."""
    run_dir = prepared(tmp_path, None, ["trainer.steps=3"])
    (run_dir / "config.yaml").write_text("trainer:\n  steps: [3,\n")
    capsys.readouterr()
    prepared(tmp_path, None, ["trainer.steps=3"])
    assert "cannot be read" in capsys.readouterr().err
    assert (run_dir / "config.yaml.1").read_text() == "trainer:\n  steps: [3,\n"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["steps"] == 3


def test_the_record_read_back_as_a_config_runs_its_own_embedded_redis(tmp_path):
    """`up --config RUN_DIR/config.yaml` (the resolved config, which client commands are pointed at too) read the
    embedded Redis URL and the ports an earlier start picked: the URL was taken for a Redis of the user's, and `up`
    waited for that dead one for ever. The record's first line lists them; its body leaves them out."""
    import types  # noqa: PLC0415 - this test only

    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  steps: 3\n")
    run_dir = tmp_path / "run"
    lock = RunLock.acquire(run_dir, "test")
    try:
        cfg = load_config(config, [])
        embedded = types.SimpleNamespace(url="redis://127.0.0.1:37837/0", password="pw")
        _prepare(cfg, config, [], run_dir, device_plan(cfg, run_dir), embedded, lock)
    finally:
        lock.release()
    text = (run_dir / "config.yaml").read_text()
    assert "redis.url=redis://127.0.0.1:37837/0" in text.splitlines()[0]  # the record of what this start ran
    again = load_config(run_dir / "config.yaml", [])
    assert again.redis.url is None and again.trainer.port == load_config(None, []).trainer.port
    assert again.trainer.steps == 3
