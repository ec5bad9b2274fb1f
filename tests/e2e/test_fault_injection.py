"""Fault injection on the CPU demo config: nothing accepted is lost or trained twice.

One run of the demo (shortened: fewer steps, a shorter warm start, no evaluations) as separate processes:
Redis (AOF, fsync on every write), a standalone ingest, the trainer and two samplers. The trainer and the
ingest start before Redis and must wait for it. During RL, at randomised steps and in random order, the
test kills (SIGKILL) the trainer twice, a sampler twice, the ingest once, and Redis once, and starts each
again after a random pause. The run must reach its step count, every process must exit 0 (the ingest on
SIGTERM), and `grpo-stream audit` must find zero groups lost and zero trained twice.

The seed of the schedule is printed (and taken from GRPO_FAULT_SEED when set) so a failure can be replayed.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

from grpo_stream.common.rollouts.buffer import keys
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, connect, free_port
from tests.e2e.test_up import ROOT
from tests.support import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow, pytest.mark.chaos]  # beside the 40-fault run
CONFIG = ROOT / "configs" / "tiny_arith.yaml"
STEPS, EVERY = 60, 5
FAULTS = ["trainer", "trainer", "sampler", "sampler", "ingest", "redis"]


class Cluster:
    """The run's processes, each restartable under its name; every incarnation logs to its own file."""

    def __init__(self, run_dir: pathlib.Path, overrides: list[str]):
        self.run_dir, self.overrides = run_dir, overrides
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def command(self, name: str) -> list[str]:
        base = [sys.executable, "-m", "grpo_stream"]
        cfg = ["--config", str(CONFIG), *self.overrides]
        if name == "trainer":
            return [*base, "trainer", *cfg[:2], "--run-dir", str(self.run_dir), *cfg[2:]]
        if name == "ingest":
            return [*base, "ingest", *cfg]
        index = name.rsplit("-", 1)[1]
        return [*base, "sampler", *cfg[:2], "--index", index, "--run-dir", str(self.run_dir), *cfg[2:]]

    def start(self, name: str) -> None:
        self.starts[name] = self.starts.get(name, 0) + 1
        log = open(self.run_dir / "logs" / f"{name}.{self.starts[name]}.log", "w")
        auth = self.run_dir / "auth"
        secret = ({"GRPO_STREAM_TOKENS_FILE": str(auth / "tokens.yaml")} if name in ("trainer", "ingest") else
                  {"GRPO_STREAM_TOKEN_FILE": str(auth / "sampler.token")})
        self.procs[name] = subprocess.Popen(self.command(name), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1", **secret})

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        assert proc.poll() is None, f"{name} had already exited with {proc.returncode} before its fault"
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def log(self, name: str) -> str:
        return (self.run_dir / "logs" / f"{name}.{self.starts[name]}.log").read_text()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def last_step(url: str, run: str) -> tuple[int, str]:
    """(step, trainer epoch) of the newest step logged in the audit trail; (0, '') before RL, (-1, '') while Redis
    is away."""
    try:
        client = connect(url, 0.5, log_retries=False)
        newest = client.xrevrange(keys("grpo-stream", run)["audit:steps"], count=1)
        client.close()
    except Exception:  # noqa: BLE001 - Redis may be the process that is down
        return -1, ""
    return (int(newest[0][1][b"step"]), newest[0][1][b"epoch"].decode()) if newest else (0, "")


class RedisAtPort:
    """The run's Redis (embedded, AOF), killed and started again on the same port and data."""

    def __init__(self, port: int, data_dir: pathlib.Path):
        self.port, self.data_dir, self.server = port, data_dir, None

    def start(self) -> None:
        self.server = EmbeddedRedis(port=self.port, data_dir=self.data_dir).start()

    def kill(self) -> None:
        self.server.kill()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def fault_schedule(rng: random.Random) -> list[tuple[int, str]]:
    """(trainer step, process) for each fault: distinct RL steps, random order, a random sampler for each sampler
    fault; the last early enough for the trainer to come back and finish."""
    at_steps = sorted(rng.sample(range(6, STEPS - 12, 3), len(FAULTS)))
    order = rng.sample(FAULTS, len(FAULTS))
    return [(step, "sampler-%d" % rng.randrange(2) if what == "sampler" else what)
            for step, what in zip(at_steps, order)]


def inject(cluster: Cluster, redis: RedisAtPort, schedule, url: str, run: str, rng: random.Random,
           deadline: float) -> list[tuple[str, int]]:
    """Kills each process of `schedule` (SIGKILL) once its step is reached by a trainer that is training, and starts
    it again after a random outage; returns (process, trainer step) of each fault."""
    injected, dead_epochs = [], {""}
    for step, what in schedule:
        # the step reached, by a trainer that is training (not one killed earlier, nor one still starting)
        ready = {"trainer": "", "redis": "", "ingest": "ingest for run"}.get(what, "connected to")
        while (now := last_step(url, run))[0] < step or now[1] in dead_epochs or ready not in cluster.log(
                what if what != "redis" else "trainer"):
            assert time.monotonic() < deadline, f"no progress to step {step}; faults so far {injected}"
            assert cluster.procs["trainer"].poll() is None, cluster.log("trainer")[-3000:]
            time.sleep(0.2)
        time.sleep(rng.uniform(0, 1.5))  # kill somewhere inside the step, not at its boundary (not a wait)
        if what == "redis":
            redis.kill()
        else:
            cluster.kill(what)
        at = last_step(url, run) if what != "redis" else now
        injected.append((what, at[0]))
        if what == "trainer":
            dead_epochs.add(at[1])
        time.sleep(rng.uniform(0.5, 3.0))  # a random outage before the restart: part of the fault, not a wait
        if what == "redis":
            redis.start()
        else:
            cluster.start(what)
    return injected


def check_audit(run_dir: pathlib.Path, cluster: Cluster, schedule, injected, seed: int) -> None:
    """The run finished whole: nothing lost or trained twice, every restart resumed, the trail compacted meanwhile."""
    report = json.loads((run_dir / "audit.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and not summary["stopped_early"]
    assert report["final_step"] == STEPS and report["lineage_missing_steps"] == []
    assert report["groups_lost"] == 0 and report["groups_trained_twice"] == 0
    assert report["groups_trained"] == STEPS * load_config(CONFIG).trainer.groups_per_step
    dropped = sum(report["groups_dropped"].values())
    assert report["groups_accepted"] == report["groups_trained"] + dropped + report["groups_waiting"]
    assert report["trainer_starts"] == 3 and report["trainer_resumes"] == 2
    # the audit trail was compacted behind the acknowledged checkpoints while the faults hit, and the verdict above
    # counts the compacted groups (buffer.compact_audit, on by default)
    assert STEPS - 3 * EVERY <= report["compacted"]["through_step"] < STEPS, report["compacted"]
    assert report["compacted"]["groups"] > 0
    for i in range(2):  # a restarted sampler continues its prompt stream after its last accepted group
        for k in range(2, cluster.starts[f"sampler-{i}"] + 1):
            text = (run_dir / "logs" / f"sampler-{i}.{k}.log").read_text()
            assert "data position 0\n" not in text and "data position" in text, text[-2000:]
    assert cluster.starts == {"trainer": 3, "ingest": 2, "sampler-0": 1 + sum(w == "sampler-0" for _, w in schedule),
                              "sampler-1": 1 + sum(w == "sampler-1" for _, w in schedule)}
    figures = {"seed": seed, "faults": injected, **{k: report[k] for k in (
        "groups_accepted", "groups_trained", "groups_dropped", "groups_waiting", "groups_lost", "groups_trained_twice",
        "steps_rolled_back", "second_copies_refused_by_ingest", "second_copies_dropped_by_trainer")}}
    print("figures:", json.dumps(figures))


def test_kill_everything_lose_nothing(tmp_path):
    seed = int(os.environ.get("GRPO_FAULT_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    print(f"fault schedule seed {seed} (GRPO_FAULT_SEED={seed} replays it)")
    run, run_dir = "faults", tmp_path / "run"
    redis_port, trainer_port, ingest_port = free_port(), free_port(), free_port()
    url = f"redis://127.0.0.1:{redis_port}/0"
    overrides = [f"run.name={run}", f"redis.url={url}", f"trainer.port={trainer_port}", "ingest.standalone=true",
                 f"ingest.port={ingest_port}", f"trainer.steps={STEPS}", f"checkpoint.every={EVERY}",
                 "warmstart.steps=150", "trainer.eval_before=false", "trainer.eval_after=false",
                 "trainer.final_wait_s=60", "trainer.metrics_port=null", "sampler.metrics_port=null"]
    cluster, redis = Cluster(run_dir, overrides), RedisAtPort(redis_port, tmp_path / "redis")
    made = subprocess.run([sys.executable, "-m", "grpo_stream", "tokens", "--out", str(run_dir / "auth")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    schedule = fault_schedule(rng)
    print("schedule (trainer step, process):", schedule)
    try:
        for name in ("trainer", "ingest"):  # before Redis: they must wait for it, not crash-loop
            cluster.start(name)
        # each must log that it waits, and keep retrying rather than crash-loop: three attempts, 0.2 s + 0.4 s +
        # 0.8 s of back-off apart (a loaded machine takes a while to import JAX first)
        def retrying(name: str) -> bool:
            assert cluster.procs[name].poll() is None, cluster.log(name)
            return cluster.log(name).count("(redis.url) not reachable") >= 3

        for name in ("trainer", "ingest"):
            wait_for(lambda: retrying(name), 90, f"{name} to log three attempts to reach Redis", interval_s=0.2)
        redis.start()
        for i in range(2):
            cluster.start(f"sampler-{i}")
        deadline = time.monotonic() + 1500
        injected = inject(cluster, redis, schedule, url, run, rng, deadline)
        print("faults injected (process, trainer step):", injected)
        assert cluster.procs["trainer"].wait(timeout=max(60.0, deadline - time.monotonic())) == 0, \
            cluster.log("trainer")[-3000:]
        for i in range(2):
            assert cluster.procs[f"sampler-{i}"].wait(timeout=120) == 0, cluster.log(f"sampler-{i}")[-3000:]
        cluster.procs["ingest"].send_signal(signal.SIGTERM)
        assert cluster.procs["ingest"].wait(timeout=30) == 0, cluster.log("ingest")[-2000:]
        audit = subprocess.run([sys.executable, "-m", "grpo_stream", "audit", str(run_dir), "--redis-url", url],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        cluster.stop_all()
        redis.stop()
    print(audit.stdout)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    check_audit(run_dir, cluster, schedule, injected, seed)
