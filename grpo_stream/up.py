"""`grpo-stream up`: the whole loop on one machine, as separate OS processes.

Starts an embedded redis-server (unless redis.url is set; its append-only
file lives in RUN_DIR/redis; a random password, given to the trainer and
ingest in their environment; common/rollouts/redis_server.py), then the trainer, the ingest when it runs on
its own, and `sampler.replicas` samplers with exactly the commands a
multi-host deployment runs (`python -m grpo_stream trainer|ingest|sampler
...`), relays their output with a prefix (and into RUN_DIR/logs/), stops
everything on Ctrl-C, SIGTERM or SIGHUP, restarts a process that fails (up.restart; grpo_stream/supervise.py) and stops
everything when one crash-loops (up.restart_limit_burst), and completes
RUN_DIR/summary.json. Running it again on the same RUN_DIR resumes: the
buffer is still in RUN_DIR/redis and the trainer's checkpoints in
RUN_DIR/checkpoints. One `up` at a time owns a RUN_DIR, and its processes die
with it (grpo_stream/up_guard.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from grpo_stream.common.config.loading import load_config, to_yaml
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.weights.registry import transport_spec
from grpo_stream.trainer_service.run_outputs import wasted_fraction
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, RedisConnectError, connect_durable, free_port
from grpo_stream.trainer_service.multihost import ADVERTISE_ENV
from grpo_stream.trainer_service.control_messages import SECRET_ENV, SECRET_FILE_ENV, new_secret
from grpo_stream.supervise import Supervisor
from grpo_stream.up_guard import STOP_SIGNALS, child_popen, lock_run_dir, redis_popen
from grpo_stream.up_secrets import sampler_token_env, with_redis_password, with_run_tokens
from grpo_stream.common.runtime.device_plan import (DeviceLayoutError, DevicePlan, ProcessPlan, detect_gpus,
                                                    host_devices_needed, load_figures, plan_devices)

ENDPOINTS_FILE = "endpoints.json"  # in RUN_DIR: where `grpo-stream submit --run-dir` sends prompts


class _Child:
    def __init__(self, name: str, cmd: list[str], log_dir: pathlib.Path, env: dict[str, str], start: bool = True):
        self.name, self.cmd, self.env = name, cmd, env
        self.log_path = log_dir / f"{name}.log"
        self.starts = 0
        if start:
            self.start()

    def start(self) -> None:
        """Start the process (again, after a failure: its log goes on in the same file)."""
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     start_new_session=True, **child_popen(self.env))  # it dies with `up`
        self._relay = threading.Thread(target=self._pump, args=(self.proc, "w" if self.starts == 0 else "a"),
                                       daemon=True)
        self.starts += 1
        self._relay.start()

    def _pump(self, proc: subprocess.Popen, mode: str) -> None:
        with open(self.log_path, mode) as log_file:
            for line in proc.stdout:
                log_file.write(line)
                log_file.flush()
                sys.stdout.write(f"[{self.name}] {line}")
                sys.stdout.flush()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int:
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print(f"[up] {self.name} did not stop within {timeout_s:.0f}s; killing it", flush=True)
            self.proc.kill()
            code = self.proc.wait()
        self._relay.join(timeout=5)
        return code


class _TrainerJob:
    """A trainer of trainer.processes JAX processes, supervised as one process (a JobSet restarts all its pods):
    when one fails the others are killed (they would wait in their collectives for ever) and a restart starts
    them all again, on a fresh coordinator port. Logs: logs/trainer.log (process 0) and logs/trainer-<k>.log."""

    def __init__(self, cmd: list[str], log_dir: pathlib.Path, envs: list[dict[str, str]]):
        """`envs`: each process's environment (its GPUs differ)."""
        self.name, self.log_path, self.starts = "trainer", log_dir / "trainer.log", 0
        self.members = [_Child("trainer" if k == 0 else f"trainer-{k}", cmd, log_dir, self._env(env, k, len(envs)),
                               start=False) for k, env in enumerate(envs)]
        self.proc = self
        self.start()

    @staticmethod
    def _env(env: dict[str, str], k: int, n: int) -> dict[str, str]:
        return {**env, "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(k), ADVERTISE_ENV: "127.0.0.1"}

    def start(self) -> None:
        # the coordinator listens on loopback only (JAX binds every interface unless told), and each start's
        # processes share a fresh secret that seals their messages (trainer_service/control_messages.py); it goes in
        # their environment, never a command line (`ps` shows those to every user)
        coordinator, secret = f"127.0.0.1:{free_port()}", new_secret()
        for member in self.members:
            member.env = {**{k: v for k, v in member.env.items() if k != SECRET_FILE_ENV},
                          "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_COORDINATOR_BIND_ADDRESS": coordinator,
                          SECRET_ENV: secret}
            member.start()
        self.starts += 1

    # the Popen calls `up` makes on a process
    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        codes = [m.proc.poll() for m in self.members]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:  # one failed: the others cannot go on without it
            for m in self.members:
                if m.proc.poll() is None:
                    m.proc.kill()
                    m.proc.wait()
            return failed[0]
        return 0 if all(c == 0 for c in codes) else None

    def terminate(self) -> None:
        for m in self.members:
            m.terminate()

    def wait(self, timeout_s: float) -> int:
        deadline = time.time() + timeout_s
        codes = [m.wait(max(1.0, deadline - time.time())) for m in self.members]
        return next((c for c in codes if c != 0), 0)


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


def device_plan(cfg: RunConfig, run_dir: pathlib.Path) -> DevicePlan:
    """The run's GPUs per process (common/runtime/device_plan.py), printed and kept in RUN_DIR/devices.json."""
    gpu_ids, memory = detect_gpus(cfg, os.environ)
    plan = plan_devices(cfg, gpu_ids, memory, load_figures(cfg))
    for line in plan.lines():
        print(f"[up] {line}", flush=True)
    (run_dir / "devices.json").write_text(json.dumps(plan.to_json(), indent=1))
    return plan


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


def run_up(config_path: pathlib.Path | None, overrides: list[str], cfg: RunConfig, run_dir: pathlib.Path) -> int:
    started = time.time()
    run_dir.mkdir(parents=True, exist_ok=True)
    run_lock = lock_run_dir(run_dir)  # one run per directory: before anything in it is written or started
    if run_lock is None:
        return 1
    try:
        devices = device_plan(cfg, run_dir)
    except DeviceLayoutError as exc:
        print(f"grpo-stream up: error: {exc}", file=sys.stderr)
        return 2
    log_dir = run_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    redis_server = None
    extra = list(overrides)
    try:
        if cfg.redis.url is None:
            redis_server = EmbeddedRedis(data_dir=(run_dir / "redis").resolve(), protected=True,
                                         popen_options=redis_popen(run_lock)).start()
            extra.append(f"redis.url={redis_server.url}")
            print(f"[up] embedded Redis at {redis_server.url} ({redis_server.describe()})", flush=True)
        else:  # fail before starting any process when the given Redis is not there, or can lose data
            connect_durable(cfg.redis, "run").close()
    except RedisConnectError as exc:
        print(f"grpo-stream up: error: {exc}", file=sys.stderr)
        return 1
    trainer_port = free_ports(cfg.trainer.processes)  # trainer process k serves on trainer.port + k
    extra.append(f"trainer.port={trainer_port}")
    prompts_address = f"127.0.0.1:{trainer_port}"
    if cfg.ingest.standalone and not cfg.ingest.address:
        ingest_port = free_port()
        extra.append(f"ingest.port={ingest_port}")
        prompts_address = f"127.0.0.1:{ingest_port}"
    elif cfg.ingest.standalone:
        prompts_address = cfg.ingest.address
    if transport_spec(cfg.weights.transport).needs_dir and not cfg.weights.checkpoint_dir:
        extra.append(f"weights.checkpoint_dir={(run_dir / 'weights').resolve()}")
    base = [sys.executable, "-m", "grpo_stream"]
    cfg_args = ["--config", str(config_path)] if config_path else []
    server_env, sampler_env, client_token = with_run_tokens(cfg, run_dir, {**os.environ, "PYTHONUNBUFFERED": "1"})
    server_env, sampler_env = with_redis_password(server_env, sampler_env, redis_server)
    (run_dir / ENDPOINTS_FILE).write_text(json.dumps({"prompts": prompts_address, "tls": cfg.tls.enabled,
                                                      "client_token_file": client_token}))
    colocated = transport_spec(cfg.weights.transport).in_process
    trainer_envs, sampler_envs = process_envs(cfg, devices, server_env, sampler_env)
    trainer_envs = [run_lock.child_env(env) for env in trainer_envs]  # the trainer holds the run's lock too
    children: list[_Child] = []
    interrupted = False

    def _interrupt(signum, _frame):
        nonlocal interrupted
        interrupted = True
        print(f"[up] signal {signum}: stopping every process", flush=True)
        for child in children:
            child.terminate()

    previous = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
    try:
        # the resolved config every process runs (file, overrides and what `up` added), and how it was asked for
        (run_dir / "config.yaml").write_text(
            f"# resolved by `grpo-stream up` from --config {config_path} with overrides {extra}\n"
            + to_yaml(load_config(config_path, extra)))
        trainer_cmd = [*base, "colocated" if colocated else "trainer", *cfg_args, "--run-dir", str(run_dir), *extra]
        trainer = (_TrainerJob(trainer_cmd, log_dir, trainer_envs) if cfg.trainer.processes > 1
                   else _Child("colocated" if colocated else "trainer", trainer_cmd, log_dir, trainer_envs[0]))
        children.append(trainer)
        # (the config refuses ingest.standalone with weights.transport=local)
        helpers = ([_Child("ingest", [*base, "ingest", *cfg_args, *extra], log_dir, server_env)]
                   if cfg.ingest.standalone else [])
        children.extend(helpers)
        sampler_base = [cfg.sampler.python or sys.executable, "-m", "grpo_stream"]  # e.g. the vLLM environment's
        samplers = [] if colocated else [
            _Child(f"sampler-{i}", [*sampler_base, "sampler", *cfg_args, "--index", str(i), "--run-dir", str(run_dir),
                                    *extra, *devices.process(f"sampler-{i}").overrides], log_dir, sampler_envs[i])
            for i in range(cfg.sampler.replicas)]
        children.extend(samplers)
        supervisor = supervise(cfg, trainer, helpers + samplers, redis_server, children, lambda: interrupted)
        trainer_code = trainer.wait(timeout_s=120)
        sampler_codes = {}
        for child in samplers:
            if trainer_code == 0:  # a sampler stops by itself at the final version; one that missed it is told to
                try:
                    child.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    print(f"[up] {child.name} still running 30s after the trainer finished; stopping it", flush=True)
            child.terminate()
            sampler_codes[child.name] = child.wait(timeout_s=30 if trainer_code == 0 else 20)
            if sampler_codes[child.name] is None or child.proc.poll() is None:
                child.terminate()
        for child in helpers:  # the ingest serves until the samplers are done
            child.terminate()
            child.wait(timeout_s=20)
    finally:
        for child in children:
            child.terminate()
        for s, handler in previous.items():
            signal.signal(s, handler)
        if redis_server is not None:
            redis_server.stop()
        run_lock.release()

    summary_path = run_dir / "summary.json"
    if trainer_code != 0 or not summary_path.exists():
        print(f"grpo-stream up: trainer exited with code {trainer_code}; see {trainer.log_path}", file=sys.stderr)
        return 130 if interrupted else (trainer_code or 1)
    summary = json.loads(summary_path.read_text())
    summary["trainer_wall_seconds"] = summary.pop("wall_seconds")
    summary["wall_seconds"] = round(time.time() - started, 2)
    summary["sampler_exit_codes"] = sampler_codes
    summary["restarts"] = {name: supervisor.restarts[name] for name in
                           ["redis-server"] * (redis_server is not None) + [child.name for child in children]}
    summary["samplers"] = {path.stem: json.loads(path.read_text()) for path in sorted(run_dir.glob("sampler-*.json"))}
    if summary["samplers"] and all("groups_generated" in s for s in summary["samplers"].values()):
        # the samplers' own final counts (their last reports to the trainer may miss the last batches)
        generated = sum(s["groups_generated"] for s in summary["samplers"].values())
        summary["groups_generated"] = generated
        summary["generation_wasted_fraction"] = wasted_fraction(
            generated, (summary["steps"] - (summary["resumed_from"] or {}).get("step", 0))
            * cfg.trainer.groups_per_step)
    summary_path.write_text(json.dumps(summary, indent=2))
    dropped = sum(summary[f"groups_dropped_{kind}"] for kind in ("stale", "invalid", "filtered", "duplicate"))
    print(f"[up] done in {summary['wall_seconds']:.0f}s: {summary['steps']} steps, groups ingested "
          f"{summary['groups_ingested']} = trained {summary['groups_trained']} + dropped "
          f"{dropped} + left {summary['groups_left_in_buffer']}; held-out {_eval_change(summary)}; "
          f"summary: {summary_path}", flush=True)
    if interrupted:
        return 130
    return 0 if all(code == 0 for code in sampler_codes.values()) else 1


def supervise(cfg: RunConfig, trainer: _Child, others: list[_Child], redis_server: EmbeddedRedis | None,
              children: list[_Child], interrupted: Callable[[], bool]) -> Supervisor:
    """Watch the processes until the trainer finishes (exit 0), restarting failed ones per cfg.up; returns the
    supervisor (its restart counts). Stops every process when one fails past its restarts or on Ctrl-C."""
    supervisor = Supervisor(cfg.up)
    by_name = {child.name: child for child in [trainer, *others]}
    while not interrupted():
        if trainer.proc.poll() == 0 and not supervisor.waiting(trainer.name):
            return supervisor
        failed = [c.name for c in [trainer, *others]
                  if c.proc.poll() not in (None, 0) and not supervisor.waiting(c.name)]
        redis_died = redis_server is not None and redis_server.proc.poll() is not None
        if redis_died and not supervisor.waiting("redis-server"):
            failed.append("redis-server")
        for name in failed:
            code = redis_server.proc.returncode if name == "redis-server" else by_name[name].proc.returncode
            delay = supervisor.failed(name)
            if delay is None:
                print(f"[up] {name} exited with code {code}; stopping the run ({supervisor.budget(name)})",
                      flush=True)
                for child in children:
                    child.terminate()
                return supervisor
            print(f"[up] {name} exited with code {code}; restarting it in {delay:.1f}s ({supervisor.budget(name)})",
                  flush=True)
        for name in supervisor.due():
            if name == "redis-server":
                redis_server.start()  # same port and data directory: it replays its AOF
            else:
                by_name[name].start()
        time.sleep(0.2)
    return supervisor


def _eval_change(summary: dict) -> str:
    """'greedy accuracy 0.525 -> 0.759, sampled pass@1 0.413 -> 0.603' (pass@1 when eval.samples > 0)."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}

    def fmt(value) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)
    text = f"greedy accuracy {fmt(before.get('accuracy'))} -> {fmt(after.get('accuracy'))}"
    if (before.get("pass_at_k") or {}).get("1") is not None:
        text += f", sampled pass@1 {fmt(before['pass_at_k']['1'])} -> {fmt((after.get('pass_at_k') or {}).get('1'))}"
    return text
