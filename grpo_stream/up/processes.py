"""What `grpo-stream up` starts, as data: each process's name, command line, environment and role, decided from the
config, the run directory and what `up` prepared (ports, tokens, the device plan) before anything starts. Pure: it
starts nothing, so it is read and tested on its own (tests/unit/test_up_plan.py); grpo_stream/up/run.py runs it.

The processes run exactly the commands a multi-host deployment runs (`python -m grpo_stream trainer|ingest|sampler
...`), with the run's overrides (the user's, then up's: the Redis URL, ports, the weights directory).
"""

from __future__ import annotations

import pathlib
import socket
import sys
from dataclasses import dataclass, field
from typing import Mapping

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.plan.device_plan import DevicePlan, ProcessPlan, host_devices_needed
from grpo_stream.common.registry.transports import transport_spec
from grpo_stream.common.rollouts.redis_server import free_port
from grpo_stream.trainer_service.multihost import ADVERTISE_ENV
from grpo_stream.up.run_secrets import sampler_token_env

TRAINER_ROLES = ("trainer", "colocated")  # the processes of the trainer job, supervised (and restarted) as one


@dataclass(frozen=True)
class ProcessSpec:
    """One process of the run.

    name: its log (RUN_DIR/logs/NAME.log), the [NAME] prefix of its output, its key in summary.json's restarts.
    role: trainer | colocated | ingest | sampler.
    record: its name under RUN_DIR/failures (a permanent failure) and RUN_DIR/heartbeats (progress): trainer-<k> for
        trainer process k (colocated: trainer-0), sampler-<index>, ingest.
    """

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(repr=False)  # holds the run's secrets: kept out of reprs and logs
    role: str
    record: str


def free_ports(count: int) -> int:
    """A port p with p .. p+count-1 free on this machine."""
    while True:
        base = free_port()
        try:
            for k in range(1, count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue


def run_overrides(cfg: RunConfig, run_dir: pathlib.Path, overrides: list[str], redis_url: str | None,
                  trainer_port: int, ingest_port: int | None) -> tuple[list[str], str]:
    """(the overrides every process gets, the address of the PromptService for `grpo-stream submit`): the user's,
    then up's own: the embedded Redis's URL, the trainer's ports (process k serves on trainer.port + k), the
    standalone ingest's port, and RUN_DIR/weights when the weight transport needs a directory and none is set."""
    every = [*overrides, *([f"redis.url={redis_url}"] if redis_url else []), f"trainer.port={trainer_port}"]
    prompts = f"127.0.0.1:{trainer_port}"
    if cfg.ingest.standalone and cfg.ingest.address:
        prompts = cfg.ingest.address
    elif cfg.ingest.standalone and ingest_port is not None:
        every.append(f"ingest.port={ingest_port}")
        prompts = f"127.0.0.1:{ingest_port}"
    if transport_spec(cfg.weights.transport).needs_dir and not cfg.weights.checkpoint_dir:
        every.append(f"weights.checkpoint_dir={(run_dir / 'weights').resolve()}")
    return every, prompts


def plan_processes(cfg: RunConfig, run_dir: pathlib.Path, config_path: pathlib.Path | None, overrides: list[str],
                   devices: DevicePlan, server_env: Mapping[str, str], sampler_env: Mapping[str, str],
                   lock_env: Mapping[str, str] | None = None, python: str = sys.executable) -> list[ProcessSpec]:
    """The run's processes in start order: the trainer job (trainer.processes processes, or the one colocated
    process with weights.transport=local), the standalone ingest (ingest.standalone), the samplers.

    overrides: `run_overrides`'s. server_env / sampler_env: the environments of the processes that serve (trainer,
    ingest: the token table, Redis's password) and of the samplers (their token). lock_env: what hands the trainer
    the run directory's lock (grpo_stream/up/run_lock.py: RunLock.child_env)."""
    trainer_envs, sampler_envs = process_envs(cfg, devices, dict(server_env), dict(sampler_env))
    cfg_args = ("--config", str(config_path)) if config_path else ()
    base = (python, "-m", "grpo_stream")
    role = "colocated" if transport_spec(cfg.weights.transport).in_process else "trainer"
    n = cfg.trainer.processes
    trainer_argv = (*base, role, *cfg_args, "--run-dir", str(run_dir), *overrides)
    specs = [ProcessSpec(role if k == 0 else f"trainer-{k}", trainer_argv,
                         {**env, **(lock_env or {}), **(job_env(k, n) if n > 1 else {})}, role, f"trainer-{k}")
             for k, env in enumerate(trainer_envs)]
    if cfg.ingest.standalone:  # (the config refuses ingest.standalone with weights.transport=local)
        specs.append(ProcessSpec("ingest", (*base, "ingest", *cfg_args, "--run-dir", str(run_dir), *overrides),
                                 dict(server_env), "ingest", "ingest"))
    sampler_base = (cfg.sampler.python or python, "-m", "grpo_stream")  # e.g. the vLLM environment's Python
    for i, env in enumerate(sampler_envs):
        argv = (*sampler_base, "sampler", *cfg_args, "--index", str(i), "--run-dir", str(run_dir), *overrides,
                *devices.process(f"sampler-{i}").overrides)
        specs.append(ProcessSpec(f"sampler-{i}", argv, env, "sampler", f"sampler-{i}"))
    return specs


def job_env(k: int, n: int) -> dict[str, str]:
    """Trainer process k of n's place in its JAX job (its coordinator address and shared secret change per start:
    grpo_stream/up/run.py)."""
    return {"JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(k), ADVERTISE_ENV: "127.0.0.1"}


def with_device_plan(env: dict[str, str], proc: ProcessPlan) -> dict[str, str]:
    """`env` with what the device plan gives process `proc`: its GPUs (CUDA_VISIBLE_DEVICES), and its memory settings
    unless the environment `up` was started with sets them (the user's choice stands)."""
    given = {k: v for k, v in proc.env.items() if k.startswith("CUDA_") or k not in env}
    return {**env, **given}


def with_host_devices(env: dict[str, str], count: int) -> dict[str, str]:
    """`env` with XLA's host platform showing `count` devices (fake CPU devices; GPUs and TPUs are unaffected),
    unless XLA_FLAGS already sets a count."""
    flags = env.get("XLA_FLAGS", "")
    if count <= 1 or "xla_force_host_platform_device_count" in flags:
        return env
    return {**env, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={count}".strip()}


def process_envs(cfg: RunConfig, plan: DevicePlan, server_env: dict[str, str],
                 sampler_env: dict[str, str]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(each trainer process's environment, each sampler's): the run's tokens, the device plan's GPUs and memory
    settings, the fake CPU devices their meshes need, then hardware.trainer_env / sampler_env over all."""
    trainer_devices, sampler_devices = host_devices_needed(cfg)
    colocated = plan.processes[0].role == "colocated"  # one process holds the trainer and the samplers
    trainer_base = {**server_env, **sampler_env} if colocated else server_env
    trainers = [p for p in plan.processes if p.role != "sampler"]
    trainer_envs = [with_host_devices({**with_device_plan(trainer_base, p), **cfg.hardware.trainer_env},
                                      trainer_devices // cfg.trainer.processes) for p in trainers]
    sampler_envs = [with_host_devices({**with_device_plan(sampler_token_env(sampler_env, i),
                                                          plan.process(f"sampler-{i}")), **cfg.hardware.sampler_env},
                                      sampler_devices) for i in range(0 if colocated else cfg.sampler.replicas)]
    return trainer_envs, sampler_envs
