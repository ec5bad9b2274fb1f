"""Bad config input gets one line naming the field and the fix: YAML files (keys given twice, alias bombs, encodings,
empty sections), dotted overrides (typos, sections set null, booleans where numbers go) and checks across sections
that would otherwise surface only as a run that never moves."""

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import ConfigError
from grpo_stream.common.config.yaml_text import read_yaml


def config_file(tmp_path, text: str | bytes):
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("text, message", [
    ("trainer:\n  steps: 5\n  groups_per_step: 4\n  steps: 9\n",
     "line 4, column 3: .*found key 'steps' a second time \\(first on line 2\\); keep one of them"),
    ("trainer:\n  steps: 5\nbuffer:\n  max_groups: 64\ntrainer:\n  groups_per_step: 4\n",
     "line 5, column 1: .*found key 'trainer' a second time \\(first on line 1\\)"),
    ("task:\n  rewards: {answer_correct: 1.0, answer_correct: 0.0}\n", "found key 'answer_correct' a second time"),
])
def test_a_key_given_twice_in_a_file_is_refused_naming_both_lines(tmp_path, text, message):
    """PyYAML keeps the last silently: the second `steps` undid the first without a word."""
    with pytest.raises(ConfigError, match=message) as err:
        load_config(config_file(tmp_path, text))
    assert "\n" not in str(err.value)


def test_a_key_given_twice_in_an_override_value_is_refused():
    with pytest.raises(ConfigError, match=r"override trainer: .*found key 'steps' a second time"):
        load_config(None, ["trainer={steps: 1, steps: 2}"])


def test_anchors_and_merge_keys_still_work_and_a_merged_key_may_be_overridden():
    data = read_yaml("base: &b {x: 0, y: 1}\nc:\n  <<: *b\n  x: 5\n"
                     "d:\n  inner: &i\n    <<: *b\n    y: 2\ne:\n  <<: *i\n")
    assert data["c"] == {"x": 5, "y": 1} and data["e"] == {"x": 0, "y": 2}


def nested_aliases(levels: int, indent: str) -> str:
    lines = [f"a0: &a0 [{', '.join(['lol'] * 10)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "".join(f"{indent}{line}\n" for line in lines)


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    """Nine nested aliases of ten: parsed in a millisecond, then 10^9 values when validated, printed by `config
    show` or saved as RUN_DIR/config.yaml (it filled memory)."""
    path = config_file(tmp_path, "sampler:\n  vllm:\n    engine_args:\n" + nested_aliases(9, "      "))
    with pytest.raises(ConfigError, match=r"not valid YAML at line 1, column 1: its aliases expand it to "
                                          r"1,234,567,9\d\d values.*billion laughs"):
        load_config(path)
    assert read_yaml(nested_aliases(3, ""))["a2"][9][9] == ["lol"] * 10  # a few hundred values: fine


def test_a_recursive_alias_is_refused():
    with pytest.raises(ConfigError, match="an alias refers to the value that contains it"):
        load_config(None, ["task.verifiers.args=&a {x: *a}"])


def test_a_file_that_is_not_utf8_names_the_byte_and_line(tmp_path):
    with pytest.raises(ConfigError, match=r"c.yaml: not UTF-8 text \(byte 0xe9 on line 2\); save it as UTF-8"):
        load_config(config_file(tmp_path, b"run:\n  name: caf\xe9\n"))
    assert load_config(config_file(tmp_path, b"\xef\xbb\xbftrainer:\n  steps: 5\n")).trainer.steps == 5  # a BOM


def test_deep_nesting_and_tabs_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(config_file(tmp_path, "a: " + "[" * 5000 + "]" * 5000 + "\n"))
    with pytest.raises(ConfigError, match=r"line 2, column 1: .*found character '\\t'") as err:
        load_config(config_file(tmp_path, "trainer:\n\tsteps: 5\n"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["trainer.metrics_port=off"], "trainer.metrics_port: got False, a boolean .* give the number meant, or null "
                                   "to turn it off"),
    (["trainer.steps=true"], "trainer.steps: got True, a boolean"),
    (["trainer.learning_rate=yes"], "trainer.learning_rate: got True, a boolean"),
    (["eval.samples=4", "eval.ks=[1, true]"], "eval.ks: got True, a boolean"),
    (["task.rewards.answer_format=on"], "task.rewards: got True, a boolean"),
])
def test_a_boolean_is_not_taken_as_a_number(overrides, message):
    """pydantic reads true as 1 and false as 0: `metrics_port: off` served metrics on a free port instead of none."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_booleans_still_set_boolean_fields_and_free_form_values():
    cfg = load_config(None, ["trainer.packing=no", "checkpoint.verify=off", "sampler.vllm.engine_args.x=true"])
    assert cfg.trainer.packing is False and cfg.checkpoint.verify is False
    assert cfg.sampler.vllm.engine_args == {"x": True}


@pytest.mark.parametrize("override, message", [
    ("trainer.stepz=3", "trainer.stepz: unknown key; did you mean trainer.steps?"),
    ("trainr.steps=3", "trainr: unknown key; did you mean trainer?"),
    ("sampler.vllm.max_num_seq=8", "sampler.vllm.max_num_seq: unknown key; did you mean sampler.vllm.max_num_seqs?"),
    ("trainer.zzz=3", "trainer.zzz: unknown key; remove it or check its spelling"),
])
def test_a_misspelt_key_is_answered_with_the_nearest_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(message)


def test_an_override_fills_a_section_the_file_leaves_null(tmp_path):
    path = config_file(tmp_path, "model:\n  lora: null\ntrainer:\n")
    cfg = load_config(path, ["model.lora.rank=8", "trainer.steps=5"])
    assert cfg.model.lora.rank == 8 and cfg.model.lora.alpha == 32.0 and cfg.trainer.steps == 5
    with pytest.raises(ConfigError, match="trainer: is empty \\(null\\), but it is a section; give it keys or "
                                          "remove it"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"override 'redis.url.x=1': redis.url is a value, not a section"):
        load_config(None, ["redis.url.x=1"])


def test_a_long_bad_value_is_quoted_short():
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"trainer.steps=[{', '.join(['1'] * 5000)}]"])
    assert len(str(err.value)) < 200


def test_a_buffer_smaller_than_a_step_is_refused():
    """Groups read for a step but not yet trained still count against buffer.max_groups: with fewer places than a
    step needs, the ingest refuses the rest and the trainer waits for ever."""
    with pytest.raises(ConfigError, match=r"^buffer.max_groups=4 < trainer.groups_per_step=16: .* raise "
                                          r"buffer.max_groups to at least 16$"):
        load_config(None, ["buffer.max_groups=4"])
    assert load_config(None, ["buffer.max_groups=16"]).buffer.max_groups == 16


@pytest.mark.parametrize("override", ["algo.advantage_eps=.inf", "algo.beta=.nan", "trainer.max_grad_norm=inf"])
def test_infinity_and_nan_are_not_numbers_a_run_can_use(override):
    """`algo.advantage_eps=.inf` zeroed every advantage (nothing learned), `.nan` in a coefficient poisons a step:
    every number field must be finite."""
    with pytest.raises(ConfigError, match=rf"{override.split('=')[0]}: Input should be a finite number"):
        load_config(None, [override])
