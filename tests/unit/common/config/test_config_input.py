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


def test_numbers_are_yaml_12s_and_text_that_yaml_11_rewrote_stays_text():
    """PyYAML's YAML 1.1 read `050151` as octal (port 20585), `1:30` as 90 (base 60) and `2024-01-01` as a date, in
    typed fields and free-form ones alike (an environment variable `010` became '8')."""
    cfg = load_config(None, ["trainer.port=050151", "hardware.trainer_env.X=010", "task.verifiers.args.t=1:30",
                             "task.verifiers.args.d=2024-01-01", "task.dataset.hub_config=2024-01-01",
                             "task.verifiers.args.odd=._", "task.verifiers.args.n=[1e3, 0x10, 1_000, 0o17, .5]"])
    assert cfg.trainer.port == 50151 and cfg.hardware.trainer_env == {"X": "010"}
    assert cfg.task.verifiers.args == {"t": "1:30", "d": "2024-01-01", "odd": "._", "n": [1000.0, 16, 1000, 15, 0.5]}
    assert cfg.task.dataset.hub_config == "2024-01-01"


@pytest.mark.parametrize("value", ["Answer, then write #### N", "/tmp/run #1/weights"])
def test_an_override_value_yaml_would_cut_at_a_comment_is_refused(value):
    """`task.system_prompt=Answer, then write #### N` ran with the system prompt 'Answer, then write'."""
    with pytest.raises(ConfigError, match=r"override task.system_prompt: YAML reads '#.*' in value .* as a comment "
                                          r"and would drop it; quote the value"):
        load_config(None, ["task.prompt_template=chat", f"task.system_prompt={value}"])
    quoted = load_config(None, ["task.prompt_template=chat", f"task.system_prompt='{value}'",
                                "task.verifiers.args.x=a#b"])
    assert quoted.task.system_prompt == value and quoted.task.verifiers.args == {"x": "a#b"}  # '#' inside a word


@pytest.mark.parametrize("override, read_as", [("run.name=yes", "a boolean"), ("task.dataset.train_split=2024",
                                                                                 "a number"),
                                               ("task.system_prompt=Think: then answer", "a mapping")])
def test_text_that_yaml_reads_as_another_type_is_answered_with_the_quoting_fix(override, read_as):
    with pytest.raises(ConfigError, match=rf"YAML read the value as {read_as}.*\); quote it, as "):
        load_config(None, ["task.prompt_template=chat", override])


def test_the_printed_config_reads_back_as_the_same_config(tmp_path):
    """`config show` and RUN_DIR/config.yaml wrote the text '1e3' bare, which the config's YAML 1.2 numbers read back
    as 1000.0: the saved config of a run named 1e3 did not load (`submit --config RUN_DIR/config.yaml`)."""
    from grpo_stream.common.config.loading import to_yaml

    cfg = load_config(None, ['run.name="1e3"', 'model.pad_token="+1E-5"', "task.verifiers.args={a: '2e3', b: '.5e1', "
                             "c: 'yes', d: 1e3, e: '010'}", "hardware.trainer_env.X='1e3'"])
    assert load_config(config_file(tmp_path, to_yaml(cfg))) == cfg


@pytest.mark.parametrize("overrides, message", [
    (["trainer.metrics_port=50151"], r"^trainer.metrics_port=50151 is also trainer.port: one process would serve two "
                                     r"servers on one port .*give trainer.metrics_port another port, or 0"),
    (["weights.data_port=7000", "trainer.port=7000"], r"^weights.data_port=7000 is also trainer.port"),
    (["sampler.metrics_port=9000", "sampler.openai.port=9000"], r"^sampler.openai.port=9000 is also "
                                                                 r"sampler.metrics_port"),
    (["sampler.metrics_port=65535"], r"^sampler.metrics_port=65535: sampler 1 serves on sampler.metrics_port \+ 1 = "
                                     r"65536, past 65535; lower it to at most 65534"),
])
def test_ports_one_process_cannot_bind_are_refused_at_load(overrides, message):
    """Accepted, they failed with 'Address already in use' (or a port past 65535) when the process started, after
    its model had loaded, naming no field."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    # a trainer's and a sampler's ports may be equal (other hosts); the gRPC data plane has no port of its own
    load_config(None, ["trainer.metrics_port=9100", "sampler.metrics_port=9100", "weights.data_plane=grpc",
                       "weights.data_port=50151", "sampler.openai.port=9200"])


def test_an_empty_teacher_is_refused_rather_than_run_as_a_distillation():
    """`distill.teacher=` (meant: off) left the teacher '' and distillation on, failing at the trainer's start."""
    with pytest.raises(ConfigError, match=r"^distill.teacher: empty: .* or set distill.teacher=null for no "
                                          r"distillation$"):
        load_config(None, ["distill.teacher="])
    assert not load_config(None, ["distill.teacher=null"]).distill.enabled
