"""`up`'s process plan, without starting anything: which processes a config gives (names, roles, the names they
record failures and heartbeats under), their command lines and environments, and the overrides `up` adds."""

import pathlib
import sys

from grpo_stream.common.config.loading import load_config
from grpo_stream.plan.device_plan import plan_devices
from grpo_stream.up.processes import plan_processes, run_overrides
from tests.conftest import CONFIGS

CONFIG = CONFIGS / "tiny_arith.yaml"
SERVER_ENV = {"GRPO_STREAM_TOKENS_FILE": "/run/auth/tokens.yaml", "GRPO_STREAM_REDIS_PASSWORD": "pw"}
SAMPLER_ENV = {"GRPO_STREAM_TOKEN_FILE": "/run/auth/sampler.token"}
LOCK = {"GRPO_STREAM_RUN_LOCK_FD": "7"}


def plan(run_dir: pathlib.Path, *overrides: str, config: pathlib.Path | None = CONFIG):
    cfg = load_config(config, list(overrides))
    every, _ = run_overrides(cfg, run_dir, list(overrides), "redis://127.0.0.1:6000/0", 7000, 7100)
    return every, plan_processes(cfg, run_dir, config, every, plan_devices(cfg, []), SERVER_ENV, SAMPLER_ENV,
                                 lock_env=LOCK, python="/py")


def test_a_default_run_is_one_trainer_and_its_samplers(tmp_path):
    every, specs = plan(tmp_path, "sampler.replicas=2")
    assert [(s.name, s.role, s.record) for s in specs] == [("trainer", "trainer", "trainer-0"),
                                                           ("sampler-0", "sampler", "sampler-0"),
                                                           ("sampler-1", "sampler", "sampler-1")]
    trainer, sampler = specs[0], specs[2]
    assert trainer.argv == ("/py", "-m", "grpo_stream", "trainer", "--config", str(CONFIG), "--run-dir", str(tmp_path),
                            *every)
    assert sampler.argv[:9] == ("/py", "-m", "grpo_stream", "sampler", "--config", str(CONFIG), "--index", "1",
                                "--run-dir")
    assert "redis.url=redis://127.0.0.1:6000/0" in every and "trainer.port=7000" in every
    # the trainer holds the run's lock and Redis's password; samplers get their token, neither of those
    assert trainer.env["GRPO_STREAM_RUN_LOCK_FD"] == "7" and trainer.env["GRPO_STREAM_REDIS_PASSWORD"] == "pw"
    assert "GRPO_STREAM_RUN_LOCK_FD" not in sampler.env and "GRPO_STREAM_REDIS_PASSWORD" not in sampler.env
    assert sampler.env["GRPO_STREAM_TOKEN_FILE"] == "/run/auth/sampler.token"
    assert "JAX_PROCESS_ID" not in trainer.env  # one process: no JAX job to join
    assert "env" not in repr(trainer)  # secrets stay out of logs


def test_a_standalone_ingest_gets_its_port_and_run_dir(tmp_path):
    every, specs = plan(tmp_path, "ingest.standalone=true", "sampler.replicas=1")
    assert [s.name for s in specs] == ["trainer", "ingest", "sampler-0"]
    ingest = specs[1]
    assert ingest.argv[3:8] == ("ingest", "--config", str(CONFIG), "--run-dir", str(tmp_path))
    assert ingest.record == "ingest" and "ingest.port=7100" in every
    assert "GRPO_STREAM_RUN_LOCK_FD" not in ingest.env and ingest.env["GRPO_STREAM_REDIS_PASSWORD"] == "pw"
    _, prompts = run_overrides(load_config(CONFIG, ["ingest.standalone=true"]), tmp_path, [], None, 7000, 7100)
    assert prompts == "127.0.0.1:7100"


def test_a_multi_process_trainer_is_one_job_of_numbered_processes(tmp_path):
    _, specs = plan(tmp_path, "trainer.processes=2", "trainer.mesh.fsdp=4", "sampler.mesh.tp=2", "sampler.replicas=1",
                    "eval.every_steps=0")  # the demo's in-run evaluation runs in one trainer process only
    job = [s for s in specs if s.role == "trainer"]
    assert [(s.name, s.record) for s in job] == [("trainer", "trainer-0"), ("trainer-1", "trainer-1")]
    assert [(s.env["JAX_NUM_PROCESSES"], s.env["JAX_PROCESS_ID"]) for s in job] == [("2", "0"), ("2", "1")]
    assert job[0].argv == job[1].argv  # the same command; the environment says which process it is
    assert all("xla_force_host_platform_device_count=2" in s.env["XLA_FLAGS"] for s in job)  # 4 devices over 2


def test_weights_transport_local_runs_one_colocated_process(tmp_path):
    _, specs = plan(tmp_path, "weights.transport=local")
    assert [(s.name, s.role, s.record) for s in specs] == [("colocated", "colocated", "trainer-0")]
    assert specs[0].argv[3] == "colocated" and specs[0].env["GRPO_STREAM_TOKEN_FILE"]  # it samples too


def test_without_a_config_file_no_config_argument_and_the_users_overrides_come_first(tmp_path):
    every, specs = plan(tmp_path, "trainer.steps=3", config=None)
    assert "--config" not in specs[0].argv and every[0] == "trainer.steps=3"
    assert specs[-1].argv[0] == "/py"


def test_the_sampler_python_is_used_for_samplers_only(tmp_path):
    _, specs = plan(tmp_path, f"sampler.python={sys.executable}")
    assert specs[0].argv[0] == "/py" and specs[-1].argv[0] == sys.executable
