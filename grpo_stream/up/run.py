"""`grpo-stream up`: the whole loop on one machine, as separate OS processes.

Starts an embedded redis-server (unless redis.url is set; its append-only file lives in RUN_DIR/redis; a random
password, given to the trainer and ingest in their environment; common/rollouts/redis_server.py), then the
processes of grpo_stream/up/processes.py: the trainer, the ingest when it runs on its own, and `sampler.replicas`
samplers, with exactly the commands a multi-host deployment runs (`python -m grpo_stream trainer|ingest|sampler
...`). It relays their output with a prefix (and into RUN_DIR/logs/), and supervises them (grpo_stream/up/supervise.py):
a process that fails is restarted (up.restart) until one crash-loops (up.restart_limit_burst), one that exits 3 (a
permanent failure) stops the run naming it, a trainer job that makes no progress for up.trainer_stall_s (a sampler:
up.sampler_stall_s) is restarted; Ctrl-C, SIGTERM or SIGHUP stop everything. At the end it completes
RUN_DIR/summary.json (grpo_stream/up/summary.py). Running it again on the same RUN_DIR resumes: the buffer is still
in RUN_DIR/redis and the trainer's checkpoints in RUN_DIR/checkpoints. One `up` at a time owns a RUN_DIR, and its
processes die with it (grpo_stream/up/guard.py).

Exit codes (the CLI's policy, grpo_stream/cli.py): 0 the trainer finished and every sampler exited 0; 1 a failure
(a process failed past its restart budget, the trainer failed, a sampler exited non-zero, Redis unreachable, the run
directory in use); 2 a device layout the host cannot hold (nothing started); 3 a process failed permanently (its
reason printed, and in summary.json's "failure" when the trainer could still write one); 130 stopped by a signal.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from grpo_stream.common.config.loading import load_config, to_yaml
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, RedisConnectError, connect_durable, free_port
from grpo_stream.plan.device_plan import (DeviceLayoutError, DevicePlan, detect_gpus, load_figures,
                                                    plan_devices)
from grpo_stream.common.runtime.errors import EXIT_FAILURE, EXIT_PERMANENT, EXIT_USAGE
from grpo_stream.up.config_record import record_config, snapshot_config
from grpo_stream.up.run_lock import RunLock
from grpo_stream.up.supervise import Outcome, Watch
from grpo_stream.common.runtime.files import write_atomic
from grpo_stream.trainer_service.control_messages import SECRET_ENV, SECRET_FILE_ENV, new_secret
from grpo_stream.up.guard import StartupSignals, StopSignals, child_popen, lock_run_dir, redis_popen, run_dir_error
from grpo_stream.up.relay import ChildLog, LogLimits, QueuedConsole, bounded_lines, relay, rotate, say_now
from grpo_stream.up.processes import (TRAINER_ROLES, ProcessSpec, free_ports, plan_processes, process_envs,
                                      run_overrides)
from grpo_stream.up.run_secrets import redacted_overrides, secrets_warning, with_redis_password, with_run_tokens
from grpo_stream.up.summary import RunEnd, RunSummary

__all__ = ["ENDPOINTS_FILE", "process_envs", "run_up"]
ENDPOINTS_FILE = "endpoints.json"  # in RUN_DIR: where `grpo-stream submit --run-dir` sends prompts


CONSOLE = QueuedConsole()  # the children's lines and `up`'s own while they run: never blocks (relay.py)
PICKED_EACH_START = ("redis.url", "trainer.port", "ingest.port")  # the embedded Redis's URL, the free ports
FINISH_S, STOP_S = 30.0, 20.0  # for the samplers (all together) to exit after the trainer finished / once told to


def _say(line: str) -> None:
    """A line on `up`'s console, if it still has one and reads: a closed terminal (SIGHUP, ssh gone), a reader that
    went away (`up | tee`, tee killed) or one that stopped reading (`up | less`, Ctrl-S) must not stop `up` from
    supervising its processes and logging to files."""
    CONSOLE.write(line + "\n")


_StopSignals = functools.partial(StopSignals, say=_say)  # its lines on `up`'s console


class _Child:
    """One process of the run (a supervise.Unit), started by `start()` (again after a failure: its log goes on; a
    log of an earlier `up` on the same run directory is rotated to NAME.log.1)."""

    must_run = False

    def __init__(self, spec: ProcessSpec, log_dir: pathlib.Path, limits: LogLimits = LogLimits()):
        self.name, self.cmd, self.env, self.records = spec.name, list(spec.argv), dict(spec.env), (spec.record,)
        self.log_path, self.limits = log_dir / f"{spec.name}.log", limits
        self.starts, self.proc, self._told_to_stop = 0, None, False

    def start(self) -> None:
        # errors="replace": a line that is not UTF-8 must not end the relay (grpo_stream/up/relay.py)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     encoding="utf-8", errors="replace", bufsize=1, start_new_session=True,
                                     **child_popen(self.env))  # it dies with `up`
        self._group_ended = self._told_to_stop = False
        if self.starts == 0 and self.log_path.exists():  # an earlier `up` here: its log may hold why it was resumed
            rotate(self.log_path, self.limits.keep)
        self._relay = threading.Thread(target=relay, args=(bounded_lines(self.proc.stdout), ChildLog(
            self.log_path, self.name, _say, self.limits), self.name, CONSOLE), daemon=True)
        self.starts += 1
        self._relay.start()

    def poll(self) -> int | None:
        code = None if self.proc is None else self.proc.poll()
        if code is not None:
            self._end_group()
        return code

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM, once per start: a process already stopping may be in its interpreter's shutdown, where Python
        has put SIGTERM's default back, and a second one ended a cleanly stopping sampler with -15 (`up` told each
        process on Ctrl-C, then told the samplers again once the trainer had checkpointed)."""
        if self.alive() and not self._told_to_stop:
            self._told_to_stop = True
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to its whole process group (it leads one: start_new_session), so what it started dies too: a
        vLLM sampler's engine-core and worker processes would otherwise live on, holding their GPU memory."""
        if self.proc is not None:
            self._end_group()
            self.proc.wait()

    def kill_now(self) -> None:
        """SIGKILL to its process group from a signal handler (a second Ctrl-C): it takes no lock and reaps nothing
        (the main thread's wait does); only while the leader is not reaped, so its pid still names its group."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _end_group(self) -> None:
        """SIGKILL to what is left of its process group, also once its leader exited: a worker it started and did
        not stop (it crashed, or stopped without them) would outlive the run, hold the GPU memory its restart needs
        and keep the relay's pipe open. Not again once the leader is gone and its group was killed: its id may then
        be reused."""
        if self._group_ended:
            return
        leader_gone = self.proc.poll() is not None
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # nothing left in it (or a member this user cannot signal)
            pass
        self._group_ended = leader_gone

    def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _say(f"[up] {self.name} did not stop within {timeout_s:.0f}s; killing it")
            self.kill()
            code = self.proc.wait()
        self._end_group()  # what it left behind: the relay ends only once nothing holds its pipe
        self._relay.join(timeout=5)
        return code


class _TrainerJob:
    """A trainer of trainer.processes JAX processes, supervised as one unit (a JobSet restarts all its pods): when
    one fails the others are killed (they would wait in their collectives for ever) and a restart starts them all
    again, on a fresh coordinator port. Logs: logs/trainer.log (process 0) and logs/trainer-<k>.log."""

    must_run = False

    def __init__(self, specs: list[ProcessSpec], log_dir: pathlib.Path, limits: LogLimits):
        self.members = [_Child(spec, log_dir, limits) for spec in specs]
        self.name, self.log_path, self.starts, self._failed = "trainer", self.members[0].log_path, 0, None
        self.records = tuple(spec.record for spec in specs)

    def start(self) -> None:
        self._failed = None
        # the coordinator listens on loopback only (JAX binds every interface unless told), and each start's
        # processes share a fresh secret that seals their messages (trainer_service/control_messages.py); it goes in
        # their environment, never a command line (`ps` shows those to every user)
        coordinator, secret = f"127.0.0.1:{free_port()}", new_secret()
        for member in self.members:
            member.env = {**{k: v for k, v in member.env.items() if k != SECRET_FILE_ENV},
                          "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_COORDINATOR_BIND_ADDRESS": coordinator,
                          SECRET_ENV: secret}
        try:
            for member in self.members:
                member.start()
        except BaseException:  # the ones started would wait for the others in their collectives for ever
            self.kill()
            raise
        self.starts += 1

    def poll(self) -> int | None:
        if self._failed is not None:  # not the codes of the processes killed for it
            return self._failed
        codes = [m.poll() for m in self.members]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:  # one failed: the others cannot go on without it
            self._failed = EXIT_PERMANENT if EXIT_PERMANENT in failed else failed[0]
            self.kill()
            return self._failed
        return 0 if all(c == 0 for c in codes) else None

    def alive(self) -> bool:
        return all(m.alive() for m in self.members)

    def terminate(self) -> None:
        for m in self.members:
            m.terminate()

    def kill(self) -> None:
        for m in self.members:
            m.kill()

    def kill_now(self) -> None:
        for m in self.members:
            m.kill_now()

    def wait(self, timeout_s: float) -> int | None:
        deadline = time.time() + timeout_s
        codes = [m.wait(max(1.0, deadline - time.time())) for m in self.members]
        return next((c for c in codes if c != 0), 0)


class _RedisUnit:
    """The embedded Redis as the watch sees it: it never exits by itself, so any exit is a failure, and a restart
    starts it on the same port and data directory (it replays its AOF). `up` stops it last, itself."""

    name, records, must_run = "redis-server", (), True

    def __init__(self, server: EmbeddedRedis, stopping: Callable[[], bool]):
        self.server, self.stopping = server, stopping

    def start(self) -> None:
        self.server.start(stopping=self.stopping)  # a restart replaying a large AOF: minutes, and a stop must end it

    def poll(self) -> int | None:
        return self.server.proc.poll()

    def alive(self) -> bool:
        return self.poll() is None

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


def device_plan(cfg: RunConfig, run_dir: pathlib.Path) -> DevicePlan:
    """The run's GPUs per process (grpo_stream/plan/device_plan.py), printed and kept in RUN_DIR/devices.json."""
    gpu_ids, memory = detect_gpus(cfg, os.environ)
    plan = plan_devices(cfg, gpu_ids, memory, load_figures(cfg))
    for line in plan.lines():
        say_now(f"[up] {line}")
    (run_dir / "devices.json").write_text(json.dumps(plan.to_json(), indent=1))
    return plan


def run_up(config_path: pathlib.Path | None, overrides: list[str], cfg: RunConfig, run_dir: pathlib.Path) -> int:
    """Run the whole loop in `run_dir` and return `up`'s exit code (module doc)."""
    started = time.time()
    run_lock = lock_run_dir(run_dir)  # one run per directory (made if new): before anything in it is written or started
    if run_lock is None:
        return EXIT_FAILURE
    redis_server = None
    try:
        try:
            with StartupSignals():
                devices = device_plan(cfg, run_dir)
                (run_dir / "logs").mkdir(exist_ok=True)
                redis_server = _start_redis(cfg, run_dir, run_lock)
                specs = _prepare(cfg, config_path, overrides, run_dir, devices, redis_server, run_lock)
        except (DeviceLayoutError, RedisConnectError) as exc:
            say_now(f"grpo-stream up: error: {exc}", sys.stderr)
            return EXIT_USAGE if isinstance(exc, DeviceLayoutError) else EXIT_FAILURE
        except OSError as exc:  # a full disk, a run directory this user cannot write: nothing started yet
            say_now(f"grpo-stream up: error: {run_dir_error(run_dir, exc)}", sys.stderr)
            return EXIT_FAILURE
        end = _run_processes(cfg, run_dir, specs, redis_server)
    finally:
        if redis_server is not None:
            redis_server.stop()
        run_lock.release()
        CONSOLE.drain()  # the children's last lines before the summary's (or the error's)
    return RunSummary(cfg, run_dir, started).finish(end)


def _start_redis(cfg: RunConfig, run_dir: pathlib.Path, run_lock: RunLock) -> EmbeddedRedis | None:
    """The run's embedded Redis, started (None with redis.url set: that one is checked to be there and durable,
    before any process starts)."""
    if cfg.redis.url is not None:
        connect_durable(cfg.redis, "run").close()
        return None
    server = EmbeddedRedis(data_dir=(run_dir / "redis").resolve(), protected=True,
                           popen_options=redis_popen(run_lock)).start()
    say_now(f"[up] embedded Redis at {server.url} ({server.describe()})")
    return server


def _prepare(cfg: RunConfig, config_path: pathlib.Path | None, overrides: list[str], run_dir: pathlib.Path,
             devices: DevicePlan, redis_server: EmbeddedRedis | None, run_lock: RunLock) -> list[ProcessSpec]:
    """Ports, tokens, RUN_DIR/endpoints.json and RUN_DIR/config.yaml; then the process plan
    (grpo_stream/up/processes.py)."""
    warning = secrets_warning(overrides)
    if warning:
        say_now(warning, sys.stderr)
    trainer_port = free_ports(cfg.trainer.processes)  # trainer process k serves on trainer.port + k
    ingest_port = free_port() if cfg.ingest.standalone and not cfg.ingest.address else None
    every, prompts = run_overrides(cfg, run_dir, overrides, redis_server.url if redis_server else None,
                                   trainer_port, ingest_port)
    server_env, sampler_env, client_token = with_run_tokens(cfg, run_dir, {**os.environ, "PYTHONUNBUFFERED": "1"})
    server_env, sampler_env = with_redis_password(server_env, sampler_env, redis_server)
    # whole or not at all: a client reading it as `up` writes it must not read half of it
    write_atomic(run_dir / ENDPOINTS_FILE, json.dumps({"prompts": prompts, "tls": cfg.tls.enabled,
                                                       "client_token_file": client_token}))
    # the resolved config every process runs (file, overrides and what `up` added), and how it was asked for; a
    # record for people (readable by all, attached to bug reports), so without the values of secret-named keys (an
    # API key in hardware.trainer_env) that the config file kept private
    # a resume with another config is said, naming each change (what `up` sets per start is none: ignored)
    source = snapshot_config(config_path, run_dir)  # what every process reads, whatever becomes of the file given
    # the body without what `up` picks at each start (the first line has it): as `up --config RUN_DIR/config.yaml`,
    # an earlier start's embedded Redis URL was a user's Redis, waited for for ever
    per_start = every[len(overrides):]
    kept = [*overrides, *(o for o in per_start if o.partition("=")[0] not in PICKED_EACH_START)]
    record_config(run_dir / "config.yaml", f"# resolved by `grpo-stream up` from --config {config_path} with overrides "
                  f"{redacted_overrides(every)} ({', '.join(PICKED_EACH_START)}: as this start picked them, and "
                  "left out below)\n" + to_yaml(load_config(source, kept), redact=True),
                  ignore=[o.partition("=")[0] for o in per_start])
    return plan_processes(cfg, run_dir, source, every, devices, server_env, sampler_env,
                          lock_env=run_lock.child_env({}))  # the trainer holds the run's lock too


def _run_processes(cfg: RunConfig, run_dir: pathlib.Path, specs: list[ProcessSpec],
                   redis_server: EmbeddedRedis | None) -> RunEnd:
    """Start the planned processes, watch them until the run ends, stop them in order."""
    log_dir, limits = run_dir / "logs", LogLimits.of(cfg.logging)
    job = [s for s in specs if s.role in TRAINER_ROLES]
    trainer = _TrainerJob(job, log_dir, limits) if len(job) > 1 else _Child(job[0], log_dir, limits)
    helpers = [_Child(s, log_dir, limits) for s in specs if s.role == "ingest"]
    samplers = [_Child(s, log_dir, limits) for s in specs if s.role == "sampler"]
    children = [trainer, *helpers, *samplers]
    stop = _StopSignals(children)
    watch = Watch(cfg.up, run_dir, trainer, [*([_RedisUnit(redis_server, lambda: stop.interrupted)] if redis_server
                                               else []), *helpers, *samplers], samplers=samplers, log=_say)
    try:
        outcome = None
        for child in children:
            outcome = outcome or watch.launch(child)  # one that cannot start stops the run only with restart=never
        outcome = outcome or watch.run(lambda: stop.interrupted)
        stop.say_received()
        stopping = outcome.reason in ("gave_up", "permanent") or stop.interrupted
        if stopping:
            for child in children:
                child.terminate()
        trainer_code, sampler_codes = _wind_down(trainer, helpers, samplers, cfg.up.stop_grace_s, stopping)
        stop.say_received()
    finally:
        for child in children:
            child.terminate()
        stop.restore()
    restarts = {name: watch.supervisor.restarts[name] for name in
                ["redis-server"] * (redis_server is not None) + [child.name for child in children]}
    # a sampler that failed within its budget and still waits out its back-off was being healed, not a failed run
    pending = tuple(child.name for child in samplers if watch.supervisor.waiting(child.name))
    return RunEnd(Outcome("interrupted") if stop.interrupted else outcome, trainer_code, sampler_codes, restarts,
                  trainer.log_path, pending)


def _wind_down(trainer, helpers: list[_Child], samplers: list[_Child], grace_s: float,
               stopping: bool = False) -> tuple[int | None, dict[str, int | None]]:
    """Wait for the trainer (`grace_s`: up.stop_grace_s), then the samplers (which stop by themselves at the final
    version; `stopping`: told to stop, STOP_S), then the ingest (it serves until the samplers are done); (trainer's
    exit code, each sampler's). Each group's wait is one deadline for all of it (8 samplers took 8 x 20 s)."""
    trainer_code = trainer.wait(timeout_s=grace_s)
    finished = trainer_code == 0 and not stopping  # a stopped trainer exits 0 too, after its checkpoint
    if finished:  # a sampler stops by itself at the final version, one that missed it is told to
        _wait_together(samplers, FINISH_S)
    for child in samplers:
        if finished and child.alive():
            _say(f"[up] {child.name} still running {FINISH_S:.0f}s after the trainer finished; stopping it")
        child.terminate()
    _wait_together(samplers, FINISH_S if finished else STOP_S, kill=True)
    sampler_codes = {child.name: child.wait(timeout_s=1) for child in samplers}
    for child in helpers:
        child.terminate()
    _wait_together(helpers, STOP_S, kill=True)
    for child in helpers:
        child.wait(timeout_s=1)
    return trainer_code, sampler_codes


def _wait_together(children: list[_Child], timeout_s: float, kill: bool = False) -> None:
    """Wait until each of `children` (those started) exited, at most `timeout_s` for all of them together; `kill`:
    then kill those still running."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            if child.proc is not None:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if kill:
                _say(f"[up] {child.name} did not stop within {timeout_s:.0f}s; killing it")
                child.kill()
