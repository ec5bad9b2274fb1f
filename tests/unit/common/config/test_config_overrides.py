"""Dotted overrides set the field they name and no other, starting from the default the section itself would give;
and a config that loads can always be printed back (`config show`, RUN_DIR/config.yaml)."""

import math

import pytest

from grpo_stream.common.config.loading import MAX_DEPTH, load_config, to_yaml
from grpo_stream.common.config.schema import ConfigError


def config_file(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_an_override_into_an_aliased_mapping_changes_that_place_alone(tmp_path):
    """PyYAML shares one object between an anchor and its aliases: `hardware.trainer_env.B=2` set B in sampler_env
    (`sampler_env: *env`) too, and an override into a merged value changed its anchor's."""
    path = config_file(tmp_path, "hardware:\n  trainer_env: &env {A: '1'}\n  sampler_env: *env\n"
                                 "task:\n  verifiers:\n    args:\n      base: &b {k: 1}\n      copy: *b\n")
    cfg = load_config(path, ["hardware.trainer_env.B=2", "task.verifiers.args.copy.k=2"])
    assert cfg.hardware.trainer_env == {"A": "1", "B": "2"} and cfg.hardware.sampler_env == {"A": "1"}
    assert cfg.task.verifiers.args == {"base": {"k": 1}, "copy": {"k": 2}}
    cfg = load_config(None, ["task.verifiers.args={a: &x {k: 1}, b: *x}", "task.verifiers.args.a.k=2"])
    assert cfg.task.verifiers.args == {"a": {"k": 2}, "b": {"k": 1}}


IFEVAL = ["task.name=ifeval", "task.dataset.source=tests/data/ifeval"]


@pytest.mark.parametrize("overrides", [[*IFEVAL, "task.rewards.ifeval_loose=0.5"],
                                       ["task.rewards.ifeval_loose=0.5", *IFEVAL]])
def test_a_key_set_in_a_mapping_keeps_the_default_its_section_gives(overrides):
    """IFEval's own rewards are {ifeval_strict: 1, ifeval_loose: 0}: `task.rewards.ifeval_loose=0.5` started from
    the field's default instead, and the run trained on answer_correct and answer_format (which score no IFEval
    reply) and ifeval_loose, without a word."""
    assert load_config(None, overrides).task.rewards == {"ifeval_strict": 1.0, "ifeval_loose": 0.5}


def test_a_mapping_default_follows_the_file_and_a_whole_value_still_replaces_it(tmp_path):
    path = config_file(tmp_path, "task:\n  name: ifeval\n  dataset: {source: tests/data/ifeval}\n")
    assert load_config(path, ["task.rewards.ifeval_strict=2"]).task.rewards == {"ifeval_strict": 2.0,
                                                                                  "ifeval_loose": 0.0}
    cfg = load_config(path, ["task.rewards.x=1", "task.rewards={ifeval_loose: 1.0}", "task.rewards.m:y=2"])
    assert cfg.task.rewards == {"ifeval_loose": 1.0, "m:y": 2.0}
    assert load_config(None, ["task.rewards.answer_format=0.5"]).task.rewards == {"answer_correct": 1.0,
                                                                                  "answer_format": 0.5}


def test_a_value_nested_too_deeply_to_print_is_refused_at_load(tmp_path):
    """Nested a few hundred levels, a value loaded, then `config show` and `up` (RUN_DIR/config.yaml) failed with
    pydantic's 'Maximum serialization depth exceeded' and a traceback naming no field."""
    deep = "[" * 300 + "]" * 300
    with pytest.raises(ConfigError, match=rf"^task.verifiers.args.x: nested more than {MAX_DEPTH} levels deep"):
        load_config(config_file(tmp_path, f"task:\n  verifiers:\n    args:\n      x: {deep}\n"))
    with pytest.raises(ConfigError, match="^task.verifiers.args.x: nested more than"):
        load_config(None, [f"task.verifiers.args.x={deep}"])
    with pytest.raises(ConfigError, match="^task.verifiers.args.a: nested more than"):
        load_config(None, ["task.verifiers.args." + ".".join(["a"] * 5000) + "=1"])
    fine = "[" * 40 + "]" * 40
    cfg = load_config(None, [f"task.verifiers.args.x={fine}"])
    assert load_config(config_file(tmp_path, to_yaml(cfg))) == cfg


@pytest.mark.parametrize("text, message", [
    ("hardware:\n  trainer_env:\n    NO: '1'\n", "hardware.trainer_env: key False is not text: YAML read the key as a "
                                                "boolean"),
    ("on: 1\n", "the top level: key True is not text"),
    ("trainer:\n  1: 2\n", "trainer: key 1 is not text: YAML read the key as a number"),
    ("task:\n  rewards: {~: 1.0}\n", "task.rewards: key None is not text: YAML read the key as null"),
])
def test_a_key_yaml_reads_as_another_type_names_its_mapping_and_the_quoting_fix(tmp_path, text, message):
    """An environment variable named NO gave 'hardware.trainer_env.0.[key]: Input should be a valid string ...;
    quote it, as hardware.trainer_env.0.[key]=...': a field that does not exist, and the key's boolean as 0."""
    with pytest.raises(ConfigError, match=rf"^{message}.*; quote it as written in the file") as err:
        load_config(config_file(tmp_path, text))
    assert "[key]" not in str(err.value)


def test_infinity_and_nan_in_a_free_form_value_print_as_themselves(tmp_path):
    """A free-form value of .inf printed (and was saved in RUN_DIR/config.yaml) as null: the record of the run, and
    plan's copy of the config, held another value than the run used."""
    cfg = load_config(None, ["task.verifiers.args={big: .inf, low: -.inf, odd: .nan}"])
    assert "big: .inf" in to_yaml(cfg) and "odd: .nan" in to_yaml(cfg)
    args = load_config(config_file(tmp_path, to_yaml(cfg))).task.verifiers.args
    assert args["big"] == math.inf and args["low"] == -math.inf and math.isnan(args["odd"])
    assert "Infinity" in cfg.model_dump_json()


def test_an_integer_too_long_for_python_to_print_is_refused_naming_the_field(tmp_path):
    """5,000 digits failed with Python's 'Exceeds the limit (4300 digits) for integer string conversion' and a
    traceback, reading the file or (written in hex, which reads) printing the config."""
    with pytest.raises(ConfigError, match=r"^--config .*c.yaml: not valid YAML at line 2, column 10: an integer 5,000 "
                                          r"characters long, more than 100"):
        load_config(config_file(tmp_path, "trainer:\n  steps: " + "9" * 5000 + "\n"))
    with pytest.raises(ConfigError, match=r"^override task.verifiers.args.x: value '0xfff.*\.\.\..*' is not valid YAML "
                                          r"at .*: an integer 5,002 characters long"):
        load_config(None, ["task.verifiers.args.x=0x" + "f" * 5000])
    cfg = load_config(None, ["task.verifiers.args.x=" + "9" * 100])
    assert cfg.task.verifiers.args == {"x": int("9" * 100)} and load_config(config_file(tmp_path, to_yaml(cfg))) == cfg


@pytest.mark.parametrize("overrides, field", [
    (["eval.ks.0=5"], "eval.ks"), (["eval.ks=[1, 2]", "eval.ks.1=5"], "eval.ks"),
    (["task.verifiers.args.l=[1]", "task.verifiers.args.l.0=2"], "task.verifiers.args.l"),
])
def test_an_override_of_a_list_item_names_the_fix(overrides, field):
    with pytest.raises(ConfigError, match=rf"{field} is a value, not a section; an override sets a list whole, as "
                                          rf"{field}='\[...\]'$"):
        load_config(None, overrides)


def test_a_misspelt_reward_is_refused_at_load_with_the_nearest_name():
    # it loaded, and failed only when a sampler built its rewards: after `up` had started the run's processes
    with pytest.raises(ConfigError, match=r"task.rewards.answer_fromat: unknown built-in reward.*'answer_format'\?"):
        load_config(None, ["task.rewards.answer_fromat=0.5"])
    loaded = load_config(None, ["task.rewards={tests.e2e.vllm_rewards:longer_is_better: 1.0, last_number: 0.5}"])
    assert loaded.task.rewards == {"tests.e2e.vllm_rewards:longer_is_better": 1.0, "last_number": 0.5}


def test_the_config_names_every_reward_the_rewards_module_scores_by():
    from grpo_stream.common.registry.rewards import BUILTIN_REWARDS
    from grpo_stream.common.tasks.rewards import REWARDS

    assert sorted(REWARDS) == sorted(BUILTIN_REWARDS)
    assert all(REWARDS[name].__name__ == spec.function for name, spec in BUILTIN_REWARDS.items())


def test_a_reward_named_by_its_dotted_import_path_can_be_set_by_a_dotted_override():
    """`task.rewards.mypkg.scoring:exact=0.5` (a reward 'package.module:function', the form the docs give) was read
    as a mapping `mypkg` and refused as 'task.rewards.mypkg: Input should be a valid number'; the keys of a mapping of
    plain values hold no sections, so the rest of the path is the key. A free-form mapping of any values still
    nests."""
    loaded = load_config(None, ["task.rewards.tests.e2e.vllm_rewards:longer_is_better=0.5",
                                "hardware.trainer_env.A.B=1", "sampler.vllm.engine_args.compilation_config.level=3"])
    assert loaded.task.rewards == {"answer_correct": 1.0, "answer_format": 0.1,
                                   "tests.e2e.vllm_rewards:longer_is_better": 0.5}
    assert loaded.hardware.trainer_env == {"A.B": "1"}
    assert loaded.sampler.vllm.engine_args == {"compilation_config": {"level": 3}}
