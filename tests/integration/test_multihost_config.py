"""Trainer processes started with different configs (another override on one host) are refused at start, in every
process, naming the settings that differ. Before, each process ran on: process 1 with trainer.eval_before=true
ran an evaluation process 0 never ran, and their collectives failed 30 s later with a Gloo error that named neither
the setting nor the process (on a TPU slice they wait for each other for ever); a learning rate of its own trains
its shards silently apart.

Three real JAX processes joined by jax.distributed on fake CPU devices, as `up` starts them, call start_group (the
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

cfg = load_config(None, ["trainer.processes=3", "trainer.mesh.fsdp=3", *sys.argv[1:]])
initialize_distributed("auto")
try:
    start_group(cfg)
    print("JOINED", flush=True)
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
jax.distributed.shutdown()
"""


def run_job(overrides: list[list[str]]) -> list[str]:
    """The last line each of three trainer processes prints, process k started with `overrides[k]`."""
    coordinator, secret = f"127.0.0.1:{free_port()}", new_secret()
    procs = [subprocess.Popen(
        [sys.executable, "-c", CHILD, *extra], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
             "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": "3", "JAX_PROCESS_ID": str(k),
             "GRPO_STREAM_ADVERTISE_HOST": "127.0.0.1", SECRET_ENV: secret}) for k, extra in enumerate(overrides)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=90)[0])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    lines = []
    for k, out in enumerate(outputs):
        verdicts = [line for line in out.splitlines() if line.startswith(("JOINED", "REFUSED"))]
        assert verdicts, f"trainer process {k} printed no verdict:\n{out[-3000:]}"
        lines.append(verdicts[-1])
    return lines


def test_processes_started_with_different_configs_all_refuse_naming_the_settings(tmp_path):
    lines = run_job([
        [], ["trainer.eval_before=false", "trainer.learning_rate=0.5"],
        ["trainer.learning_rate=0.5", f"checkpoint.dir={tmp_path}", "logging.level=DEBUG"]])  # paths: each host's
    for line in lines:  # every process's error (`up` reports one of them) names them all
        assert line.startswith("REFUSED RunRefused trainer processes started with configs other than trainer process "
                               "0's: trainer.eval_before (process(es) [1]), trainer.learning_rate (process(es) "
                               "[1, 2]). "), line
        assert "same --config file and overrides" in line


def test_processes_differing_only_in_host_local_settings_join(tmp_path):
    lines = run_job([[], [f"checkpoint.dir={tmp_path}", "runtime.compilation_cache_dir=none"],
                     ["logging.verbose=true"]])
    assert lines == ["JOINED"] * 3
