"""Trainer processes started with different configs (another override on one host) are refused at start, in every
process, naming the settings that differ. Before, each process ran on: process 1 with trainer.eval_before=true
ran an evaluation process 0 never ran, and their collectives failed 30 s later with a Gloo error that named neither
the setting nor the process (on a TPU slice they wait for each other for ever); a learning rate of its own trains
its shards silently apart.

Processes that cannot make one trainer are refused the same way: a trainer.processes=1 config in a job of several
(each ran as a whole trainer over the others' devices), a process without the shared secret (it stopped alone and
left the others waiting in a collective, on GPUs and TPUs for ever).

Real JAX processes joined by jax.distributed on fake CPU devices, as `up` starts them, call start_group (the
trainer's first step after joining); nothing of the model is built."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from grpo_stream.common.rollouts.redis_server import free_port
from grpo_stream.trainer_service.control_messages import SECRET_ENV, new_secret

ROOT = pathlib.Path(__file__).parents[2]
CHILD = """
import sys
import jax
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.model.sharding import initialize_distributed
from grpo_stream.trainer_service.multihost import start_group

cfg = load_config(None, sys.argv[1:])
initialize_distributed("auto")
try:
    print("JOINED" if start_group(cfg) is not None else "ALONE", flush=True)
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
jax.distributed.shutdown()
"""


THREE = ["trainer.processes=3", "trainer.mesh.fsdp=3"]


def run_job(overrides: list[list[str]], secrets: list[bool] | None = None) -> list[str]:
    """The verdict each trainer process prints (JOINED, ALONE or REFUSED ...), one process per item of `overrides`,
    process k started with `overrides[k]` and, unless `secrets[k]` is false, the job's shared secret."""
    coordinator, secret = f"127.0.0.1:{free_port()}", new_secret()
    procs = []
    for k, extra in enumerate(overrides):
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
               "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(len(overrides)),
               "JAX_PROCESS_ID": str(k), "GRPO_STREAM_ADVERTISE_HOST": "127.0.0.1",
               SECRET_ENV: secret if secrets is None or secrets[k] else ""}
        env.pop("GRPO_STREAM_TRAINER_SECRET_FILE", None)
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, *extra], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120)[0])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    lines = []
    for k, out in enumerate(outputs):
        verdicts = [line for line in out.splitlines() if line.startswith(("JOINED", "ALONE", "REFUSED"))]
        assert verdicts, f"trainer process {k} printed no verdict:\n{out[-3000:]}"
        lines.append(verdicts[-1])
    return lines


def test_processes_started_with_different_configs_all_refuse_naming_the_settings(tmp_path):
    lines = run_job([  # checkpoint.dir, logging: each host's
        THREE, [*THREE, "trainer.eval_before=false", "trainer.learning_rate=0.5"],
        [*THREE, "trainer.learning_rate=0.5", f"checkpoint.dir={tmp_path}", "logging.level=DEBUG"]])
    for line in lines:  # every process's error (`up` reports one of them) names them all
        assert line.startswith("REFUSED RunRefused trainer processes started with configs other than trainer process "
                               "0's: trainer.eval_before (process(es) [1]), trainer.learning_rate (process(es) "
                               "[1, 2]). "), line
        assert "same --config file and overrides" in line


def test_processes_differing_only_in_host_local_settings_join(tmp_path):
    lines = run_job([THREE, [*THREE, f"checkpoint.dir={tmp_path}", "runtime.compilation_cache_dir=none"],
                     [*THREE, "logging.verbose=true"]])
    assert lines == ["JOINED"] * 3


def test_a_one_process_trainer_config_in_a_job_of_two_processes_is_refused_in_both():
    """trainer.processes left at 1 on a JAX job of two hosts (a TPU slice joins them by itself): each process went
    on as the only trainer, on a mesh over both processes' devices, each waiting for the other in collectives."""
    for line in run_job([["trainer.mesh.fsdp=2", "trainer.processes=1"]] * 2):
        assert line.startswith("REFUSED RunRefused trainer.processes=1, but this process is one of a JAX job of 2 "
                               "processes"), line
        assert "set trainer.processes=2" in line and "distributed.initialize=never" in line


def test_a_process_without_the_shared_secret_stops_the_others_with_it_naming_it():
    """Process 1 without GRPO_STREAM_TRAINER_SECRET stopped alone: process 0 waited in the incarnation's collective
    (30 s of Gloo here, then an error naming neither the secret nor the process; on GPUs and TPUs for ever)."""
    leader, follower = run_job([["trainer.mesh.fsdp=2", "trainer.processes=2"]] * 2, secrets=[True, False])
    assert leader.startswith("REFUSED RunRefused trainer process(es) [1] have no usable shared secret "
                             "(GRPO_STREAM_TRAINER_SECRET_FILE or GRPO_STREAM_TRAINER_SECRET"), leader
    # its own reason, permanent as the others' (exit 3: restarting it meets the same)
    assert follower.startswith("REFUSED RunRefused a trainer of several processes (trainer.processes > 1) "
                               "authenticates the messages"), follower
