import pathlib

import pytest

from grpo_stream.common.config.loading import load_config, parse_override
from grpo_stream.common.config.schema import ConfigError, RunConfig

CONFIGS = pathlib.Path(__file__).resolve().parents[4] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)


def test_shipped_configs_exist():
    assert (CONFIGS / "tiny_arith.yaml").exists()


def test_unknown_key_names_the_dotted_field():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.stepz=3"])
    assert "trainer.stepz: unknown key" in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sampler:\n  replica: 2\n")
    with pytest.raises(ConfigError, match=r"sampler\.replica: unknown key"):
        load_config(path)


@pytest.mark.parametrize("bad", ["trainer.steps", "=3", "trainer..steps=3", "trainer.steps=[1,"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError, match="override"):
        load_config(None, [bad])


def test_override_values_are_typed():
    cfg = load_config(None, ["trainer.steps=7", "algo.epsilon_high=0.3", "redis.url=null", "run.name=x1"])
    assert cfg.trainer.steps == 7 and cfg.algo.epsilon_high == 0.3 and cfg.redis.url is None


def test_limits_are_enforced_with_field_names():
    with pytest.raises(ConfigError, match=r"generation\.num_generations: Input should be greater than or equal to 2"):
        load_config(None, ["generation.num_generations=1"])


def test_a_group_too_large_for_one_rollout_message_is_refused_naming_both_fields():
    """A group goes to the ingest whole, in one message: 256 completions of 32k tokens are 72 MiB, which no send can
    carry (the sampler dropped every such group at run time, after the model had loaded and generated)."""
    with pytest.raises(ConfigError, match=r"generation\.num_generations=256 .*generation\.max_new_tokens=32768 .*72 MiB"):
        load_config(None, ["generation.num_generations=256", "generation.max_new_tokens=32768"])
    assert load_config(None, ["generation.num_generations=16", "generation.max_new_tokens=32768"])


def test_staleness_must_cover_publication_cadence():
    with pytest.raises(ConfigError, match=r"trainer.max_staleness=0 < trainer.publish_every-1=2"):
        load_config(None, ["trainer.max_staleness=0", "trainer.publish_every=3"])


def test_override_into_a_value_is_refused():
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(CONFIGS / "tiny_arith.yaml", ["trainer.steps.x=1"])


def test_parse_override_splits_path():
    assert parse_override("a.b.c=5") == (["a", "b", "c"], 5)


def test_an_override_into_a_mapping_keeps_its_other_default_keys():
    """`task.rewards.answer_format=0.5` changes that weight: answer_correct stays (it used to be dropped, and the run
    trained on format alone)."""
    assert load_config(None, ["task.rewards.answer_format=0.5"]).task.rewards == {"answer_correct": 1.0,
                                                                                   "answer_format": 0.5}
    assert load_config(None, ["task.rewards={last_number: 1.0}"]).task.rewards == {"last_number": 1.0}  # whole
    assert load_config(None, ["model.lora.rank=8"]).model.lora.rank == 8  # a section from null: its own defaults


def test_numbers_read_as_yaml_1_2_and_a_comment_is_no_value(tmp_path):
    """PyYAML's 1.1 rules read `5e-1` as text, which a free-form mapping handed on to vLLM as a string."""
    cfg = load_config(None, ["sampler.vllm.engine_args.cpu_offload_gb=5e-1", "algo.epsilon_high=2e-1",
                             "hardware.sampler_env.CUDA_VISIBLE_DEVICES=1"])
    assert cfg.sampler.vllm.engine_args == {"cpu_offload_gb": 0.5} and cfg.algo.epsilon_high == 0.2
    assert cfg.hardware.sampler_env == {"CUDA_VISIBLE_DEVICES": "1"}  # an environment variable's value is text
    with pytest.raises(ConfigError, match=r"hardware.sampler_env: .*X=2.1: .*read this one as float; quote it"):
        load_config(None, ["hardware.sampler_env.X=2.10"])  # YAML already made it 2.1: not what was written
    (tmp_path / "c.yaml").write_text("sampler:\n  vllm:\n    engine_args: {swap_space: 1e1}\n")
    assert load_config(tmp_path / "c.yaml").sampler.vllm.engine_args == {"swap_space": 10.0}
    with pytest.raises(ConfigError, match=r"task.system_prompt: value '# hi' starts with '#'.*quote it"):
        parse_override("task.system_prompt=# hi")
    assert parse_override("task.system_prompt='# hi'") == (["task", "system_prompt"], "# hi")


def test_every_field_is_documented():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, RunConfig.__mro__[1]):
                walk(ann)
    walk(RunConfig)


def test_missing_file_is_one_line_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("override, message", [
    ("algo.epsilon_high=0.1", "algo.epsilon_high=0.1 < algo.epsilon=0.2"),
    ("algo.tis_cap=0", "algo.tis_cap: Input should be greater than 0"),
    ("algo.tis_cap=-1", "algo.tis_cap: Input should be greater than 0"),
    ("algo.loss_algo=ppo", "algo.loss_algo: Input should be 'grpo' or 'gspo-token'"),
    ("algo.loss_agg_mode=sum", "algo.loss_agg_mode: Input should be"),
    ("algo.advantage_estimator=gae", "algo.advantage_estimator: Input should be"),
    ("algo.kl_estimator=k4", "algo.kl_estimator: Input should be 'k1', 'k2' or 'k3'"),
    ("algo.beta=-0.1", "algo.beta: Input should be greater than or equal to 0"),
    ("algo.minibatches=3", "algo.minibatches=3 must divide the 128 sequences"),
    ("algo.overlong_buffer_tokens=99", "algo.overlong_buffer_tokens=99 exceeds generation.max_new_tokens=18"),
])
def test_bad_objective_settings_name_the_field(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny_arith.yaml", [override])
    assert message in str(err.value)


def test_tis_can_be_turned_off_and_eps_high_defaults_to_epsilon():
    cfg = load_config(CONFIGS / "tiny_arith.yaml", ["algo.tis_cap=null", "algo.epsilon=0.1"])
    assert cfg.algo.tis_cap is None and cfg.algo.eps_high == cfg.algo.eps_low == 0.1


def test_each_loss_has_its_own_clip_unless_the_config_sets_one():
    grpo = load_config(CONFIGS / "tiny_arith.yaml").algo
    gspo = load_config(CONFIGS / "tiny_arith.yaml", ["algo.loss_algo=gspo-token"]).algo
    assert (grpo.eps_low, grpo.eps_high) == (0.2, 0.2) and (gspo.eps_low, gspo.eps_high) == (3e-4, 4e-4)
    wide = load_config(CONFIGS / "tiny_arith.yaml", ["algo.loss_algo=gspo-token", "algo.epsilon=0.001"]).algo
    assert (wide.eps_low, wide.eps_high) == (0.001, 0.001)
    # GRPO's scale on GSPO's sequence ratio is the trap of issue 44: refused, naming the fix
    with pytest.raises(ConfigError, match=r"algo.epsilon=0.2.*loss_algo=gspo-token.*set both null"):
        load_config(CONFIGS / "tiny_arith.yaml", ["algo.loss_algo=gspo-token", "algo.epsilon=0.2"])


def test_synchronous_sampler_cap_must_feed_a_whole_step():
    # 2 replicas x 7 groups per version cannot fill a 16-group step: the run would deadlock
    sync = ["trainer.max_staleness=0"]
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny_arith.yaml", ["sampler.max_groups_per_version=7", *sync])
    assert "sampler.max_groups_per_version=7 x sampler.replicas=2 < trainer.groups_per_step" in str(err.value)
    cfg = load_config(CONFIGS / "tiny_arith.yaml", ["sampler.max_groups_per_version=8", *sync])
    assert cfg.sampler.max_groups_per_version == 8


def test_a_cosine_decay_that_ends_at_zero_before_the_last_step_is_refused():
    # optax holds the rate at end_lr_factor x learning_rate past decay_steps: 0 by default, so steps 21..60 (AdamW's
    # decay included) changed nothing while the run went on for them
    cosine = ["trainer.steps=60", "trainer.optimizer.schedule=warmup_cosine", "trainer.optimizer.decay_steps=20"]
    with pytest.raises(ConfigError, match=r"trainer.optimizer.decay_steps=20 < trainer.steps=60 with trainer.optimizer"
                                          r".end_lr_factor=0: .*steps 21..60 would change nothing"):
        load_config(None, cosine)
    assert load_config(None, [*cosine, "trainer.optimizer.end_lr_factor=0.1"]).trainer.optimizer.decay_steps == 20
    assert load_config(None, [*cosine, "trainer.steps=20"]).trainer.steps == 20


def test_log_format_is_text_or_json():
    assert load_config(None, ["logging.format=json"]).logging.format == "json"
    with pytest.raises(ConfigError, match="logging.format: Input should be 'text' or 'json'"):
        load_config(None, ["logging.format=xml"])


@pytest.mark.parametrize("overrides, message", [
    (["model.kind=hf"], "model.kind=hf needs model.path"),
    (["task.name=gsm8k", "warmstart.steps=0"], "task.name=gsm8k needs task.dataset.source"),
    (["task.name=gsm8k", "task.dataset.source=x", "warmstart.steps=5"], "warmstart.steps: the supervised warm start "
                                                                          r"exists for the tasks \['arith', 'arith_tools'\] only"),
    (["task.name=poetry"], r"task.name: unknown task 'poetry'; choose one of \['arith', 'arith_tools', 'gsm8k'"),
    (["environment.name=chess"], r"environment.name: unknown environment 'chess'; choose one of \['arith_tools', "
     r"'gsm8k_tools'\], or null for single-turn tasks"),
    (["environment.name=gsm8k_tools"], r"environment.name=gsm8k_tools takes the problems of task.name in \['gsm8k'\]"),
    (["environment.name=arith_tools", "environment.turn_max_new_tokens=99"], "environment.turn_max_new_tokens=99 "
     "exceeds generation.max_new_tokens=16"),
    (["eval.samples=2", "eval.ks=[1,4]"], r"eval.ks=\[1, 4\]: each k must be at most eval.samples=2"),
    (["model.dtype=float16"], "model.dtype"),
    (["task.prompt_template=fancy"], "task.prompt_template"),
    (["task.dataset.on_bad_row=ignore"], "task.dataset.on_bad_row"),
])
def test_model_task_and_eval_settings_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_presets_mirror_the_maxtext_and_tunix_demo_settings():
    for name in ("llama3.1_8b_gsm8k_tpu_host", "llama3.1_70b_gsm8k_split_slices", "qwen2.5_1.5b_gsm8k_gpu"):
        cfg = load_config(CONFIGS / f"{name}.yaml")
        assert cfg.model.kind == "hf" and cfg.task.name == "gsm8k", name
        assert (cfg.algo.beta, cfg.algo.epsilon, cfg.trainer.learning_rate) == (0.08, 0.2, 3e-6), name
        opt = cfg.trainer.optimizer  # AdamW, warmup over the first tenth, cosine to 0, clip 0.1 (Tunix's recipe)
        assert (opt.name, opt.weight_decay, opt.b1, opt.b2, opt.schedule, opt.end_lr_factor, cfg.trainer.max_grad_norm
                ) == ("adamw", 0.1, 0.9, 0.99, "warmup_cosine", 0.0, 0.1), name
        assert opt.warmup_steps == cfg.trainer.steps // 10, name
        assert (cfg.generation.max_prompt_tokens, cfg.generation.max_prompt_tokens + cfg.generation.max_new_tokens
                ) == (256, 768), name


@pytest.mark.parametrize("overrides, message", [
    (["redis.url=http://h:6379"], r"redis.url='http://h:6379' must start with redis://, rediss:// or unix://"),
    (["redis.connect_timeout_s=0"], "redis.connect_timeout_s"),
    (["checkpoint.every=0"], "checkpoint.every"),
    (["checkpoint.keep=0"], "checkpoint.keep"),
    # one checkpoint leaves nothing to fall back to when the newest is corrupt: the run could not restart
    (["checkpoint.keep=1"], "checkpoint.keep: Input should be greater than or equal to 2"),
    (["ingest.standalone=true", "weights.transport=local"], "ingest.standalone: weights.transport=local"),
])
def test_durability_settings_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_samplers_send_rollouts_to_the_ingest_address():
    assert load_config(None, ["trainer.port=7"]).ingest_address() == "127.0.0.1:7"
    assert load_config(None, ["ingest.standalone=true", "ingest.port=9"]).ingest_address() == "127.0.0.1:9"
    assert load_config(None, ["ingest.address=h:1"]).ingest_address() == "h:1"
    assert load_config(None, []).redis.connect_timeout_s is None  # wait for Redis as long as it takes


@pytest.mark.parametrize("overrides,message", [
    (["sampler.engine=tgi"], "sampler.engine: unknown engine 'tgi'; choose one of ['jax', 'vllm']"),
    (["sampler.vllm.engine_args={model: x}"], "sampler.vllm.engine_args sets ['model']"),
    (["sampler.vllm.engine_args={max_model_len: 64, swap_space: 0}"], "sets ['max_model_len']"),
    (["sampler.vllm.engine_args={kv_cache_memory_bytes: 1024}"], "sets ['kv_cache_memory_bytes']"),
    (["sampler.vllm.kv_cache_gib=0"], "sampler.vllm.kv_cache_gib: Input should be greater than 0"),
    (["sampler.vllm.weight_install=iterator", "sampler.vllm.tensor_parallel_size=2"],
     "weight_install=iterator needs tensor_parallel_size 1"),
    (["sampler.vllm.gpu_memory_utilization=1.5"], "sampler.vllm.gpu_memory_utilization: Input should be less"),
    (["sampler.engine=vllm", "weights.transport=local"], "sampler.engine=vllm runs each sampler as its own process"),
    (["sampler.vllm.steps_between_updates=0"],
     "sampler.vllm.steps_between_updates: Input should be greater than or equal to 1"),
    (["sampler.weight_updates=always"], "sampler.weight_updates: Input should be 'in_flight' or 'drain'"),
    # what earlier versions called these is refused with what replaced it
    (["sampler.weight_updates=between_batches"], "sampler.weight_updates=between_batches: there are no batches any "
     "more: 'drain' stops starting groups"),
    (["sampler.prompts_per_batch=8"], "sampler.prompts_per_batch: a sampler no longer generates in batches"),
    (["sampler.rows_in_flight=300"], "sampler.rows_in_flight=300: the engine decodes at most "
     "generation.decode_slots=256 sequences at once"),
    (["sampler.engine=vllm", "sampler.rows_in_flight=300"], "lower it to 256 or raise sampler.vllm.max_num_seqs"),
    (["sampler.rows_in_flight=4"], "sampler.rows_in_flight=4 holds no group of generation.num_generations=8"),
    # multi-turn rows may exceed the slots, but a group's rows start together: fewer slots than a group never starts
    (["generation.decode_slots=4", "sampler.rows_in_flight=null", "environment.name=arith_tools"],
     "generation.num_generations=8: a group's rows start together, and the engine decodes at most "
     "generation.decode_slots=4 sequences at once, so no group could ever start; raise generation.decode_slots"),
])
def test_vllm_engine_settings_name_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIGS / "tiny_arith.yaml", overrides)
    assert message in str(err.value)


def test_vllm_engine_settings_pass_through():
    cfg = load_config(CONFIGS / "tiny_arith.yaml", ["sampler.engine=vllm", "sampler.vllm.engine_args={swap_space: 0}",
                                                    "sampler.vllm.tensor_parallel_size=4"])
    assert cfg.sampler.engine == "vllm" and cfg.sampler.vllm.engine_args == {"swap_space": 0}
    assert cfg.sampler.vllm.weight_install == "auto"


@pytest.mark.parametrize("overrides, rule, fix", [
    # a 1-device mesh over two processes: the mesh rule alone, not the other two rules of multi-process trainers
    (["trainer.processes=2"], "must spread evenly over the processes", "make fsdp x tp a multiple of 2"),
    (["trainer.processes=2", "trainer.mesh.fsdp=2", "weights.transport=checkpoint"], "serves its own slices",
     "set weights.transport=grpc"),
    (["trainer.processes=2", "trainer.mesh.fsdp=2", "model.lora.rank=4"], "saves and publishes the frozen LoRA base",
     "trainer.processes=1"),
])
def test_a_multi_process_config_error_names_the_one_rule_broken_and_its_fix(overrides, rule, fix):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    message = str(caught.value)
    assert rule in message and fix in message
    rules = ("must spread evenly", "serves its own slices", "frozen LoRA base")
    assert sum(r in message for r in rules) == 1  # the one broken, not the whole list


def test_a_leading_tilde_in_a_file_setting_is_the_users_home(tmp_path, monkeypatch):
    """`redis.auth.password_file=~/...` typed on a command line reaches the process with the ~ as it is (bash expands
    it only at a word's start or after a shell assignment's =), as does one in YAML: the file was looked for under a
    directory named ~."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(CONFIGS / "tiny_arith.yaml",
                      ["redis.auth.password_file=~/.grpo-secrets/redis.password", "auth.tokens_file=~/tokens.yaml",
                       "model.kind=hf", "model.path=~/models/m", "warmstart.steps=0",
                       "checkpoint.dir=gs://bucket/~run"])
    assert cfg.redis.auth.password_file == str(tmp_path / ".grpo-secrets/redis.password")
    assert cfg.auth.tokens_file == str(tmp_path / "tokens.yaml") and cfg.model.path == str(tmp_path / "models/m")
    assert cfg.checkpoint.dir == "gs://bucket/~run"  # not a leading ~: left alone


def test_ifeval_scores_with_its_own_rewards_unless_told_and_refuses_answer_rewards():
    """The answer rewards score a '#### N' answer: an IFEval reference has none, so a run on IFEval's prompts with
    the default task.rewards trained on answer_format alone."""
    ifeval = ["task.name=ifeval", "task.dataset.source=tests/data/ifeval", "warmstart.steps=0"]
    cfg = load_config(CONFIGS / "tiny_arith.yaml", ifeval)
    assert cfg.task.rewards == {"ifeval_strict": 1.0, "ifeval_loose": 0.0}
    assert load_config(None, []).task.rewards == {"answer_correct": 1.0, "answer_format": 0.1}
    with pytest.raises(ConfigError, match="task.rewards=.* with task.name=ifeval"):
        load_config(None, [*ifeval, "task.rewards={answer_correct: 1.0, answer_format: 0.1}"])
    own = load_config(None, [*ifeval, "task.rewards={ifeval_loose: 1.0, answer_format: 0.0}"])
    assert own.task.rewards == {"ifeval_loose": 1.0, "answer_format": 0.0}
