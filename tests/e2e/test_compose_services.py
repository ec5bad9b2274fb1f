"""compose/docker-compose.yml for real, without a container engine: Debian's docker-compose validates the file
and resolves it (variables, anchors, .env), then each service's command line runs here as a local process with
the service's environment. Service host names come in through the file's own variables (REDIS_HOST,
TRAINER_HOST: 127.0.0.1 here, as a network's DNS would resolve them), and each volume's mount point in a
command or an environment value is the directory standing for that volume; nothing else is rewritten.
Redis is the embedded default with the password the `secrets` service made. The run must train, and every
sampler must install the trainer's versions through the final one."""

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from grpo_stream.common.rollouts.redis_server import connect, find_redis_server, free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e
COMPOSE_FILE = ROOT / "compose" / "docker-compose.yml"
STEPS = 4


def compose_binary() -> str:
    found = shutil.which("docker-compose")
    if found is None:
        why = "docker-compose not installed (Debian: apt-get install docker-compose)"
        if os.environ.get("GRPO_STREAM_REQUIRE_COMPOSE") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return found


def env_file(path: pathlib.Path, **values) -> pathlib.Path:
    """compose/.env.example with `values` changed (every key must exist there: the example stays complete)."""
    lines = (ROOT / "compose" / ".env.example").read_text().splitlines()
    keys = {line.split("=", 1)[0] for line in lines if "=" in line and not line.startswith("#")}
    assert set(values) <= keys, sorted(set(values) - keys)
    out = [f"{k}={values[k]}" if "=" in line and not line.startswith("#") and (k := line.split("=", 1)[0]) in values
           else line for line in lines]
    path.write_text("\n".join(out) + "\n")
    return path


def resolved(env: pathlib.Path) -> dict:
    proc = subprocess.run([compose_binary(), "-f", str(COMPOSE_FILE), "--env-file", str(env), "config"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_compose_file_is_valid_offline():
    proc = subprocess.run([compose_binary(), "-f", str(COMPOSE_FILE), "--env-file",
                           str(ROOT / "compose" / ".env.example"), "config", "-q"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    services = resolved(ROOT / "compose" / ".env.example")["services"]
    assert {"secrets", "redis", "trainer", "sampler-0", "sampler-1", "tensorboard"} <= set(services)
    assert services["tensorboard"]["profiles"] == ["tensorboard"]
    redis = services["redis"]
    assert any(v.startswith("redis-data:/data") for v in redis["volumes"])
    assert "requirepass" in " ".join(redis["command"])
    for name in ("trainer", "sampler-0", "sampler-1"):  # each on its own GPU by default
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    gpus = [services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0]
            for n in ("trainer", "sampler-0", "sampler-1")]
    assert len(set(gpus)) == 3


class Mounts:
    """Each service's volumes as local directories: named volumes under `root`, bind mounts as the host path,
    and the image's working directory (/app: the source tree the image copies) as this checkout."""

    def __init__(self, root: pathlib.Path):
        self.root = root

    def table(self, service: dict) -> dict[str, str]:
        table = {"/app": str(ROOT)}
        for spec in service.get("volumes", []):
            source, target = spec.split(":")[:2]
            local = pathlib.Path(source) if source.startswith("/") else self.root / source
            local.mkdir(parents=True, exist_ok=True)
            table[target] = str(local)
        return table

    def translate(self, text: str, table: dict[str, str]) -> str:
        for target, local in sorted(table.items(), key=lambda kv: -len(kv[0])):
            text = re.sub(rf"(^|=){re.escape(target)}(?=/|$)", lambda m: m.group(1) + local, text)
        return text

    def command(self, service: dict) -> tuple[list[str], dict[str, str]]:
        table = self.table(service)
        command = service["command"]
        argv = shlex.split(command) if isinstance(command, str) else list(command)
        argv = [self.translate(arg, table) for arg in argv]
        env = {k: self.translate(str(v), table) for k, v in (service.get("environment") or {}).items()}
        return argv, env


@pytest.mark.slow
@pytest.mark.redis
def test_compose_services_run_as_local_processes(tmp_path):
    ports = {k: free_port() for k in ("REDIS_PORT", "TRAINER_PORT", "WEIGHTS_DATA_PORT", "TRAINER_METRICS_PORT")}
    env_path = env_file(tmp_path / "test.env", CONFIG="configs/tiny_arith_smoke.yaml", RUN_NAME="compose",
                        IMAGE_FLAVOR="cpu", SAMPLER_ENGINE="jax", REDIS_HOST="127.0.0.1", TRAINER_HOST="127.0.0.1",
                        RUN_OVERRIDES=f"trainer.steps={STEPS} warmstart.steps=4 eval.num_problems=8 "
                                      "eval.batch_size=8 weights.verify_prompts=4",
                        **{k: str(v) for k, v in ports.items()})
    services = resolved(env_path)["services"]
    mounts = Mounts(tmp_path / "volumes")
    bin_dir = str(pathlib.Path(sys.executable).parent)  # the image's PATH has grpo-stream; here it is the venv's
    base_env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]}

    def start(name: str, log: pathlib.Path) -> subprocess.Popen:
        argv, env = mounts.command(services[name])
        with log.open("w") as out:
            return subprocess.Popen(argv, cwd=ROOT, env={**base_env, **env}, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    # 1. the one-shot secrets service, then its --keep rerun (a restarted deployment) keeps the same secrets
    secrets = mounts.table(services["secrets"])["/secrets"]
    for _ in range(2):
        assert start("secrets", tmp_path / "secrets.log").wait(60) == 0, (tmp_path / "secrets.log").read_text()
    password = pathlib.Path(secrets, "redis.password").read_text().strip()
    assert len(password) >= 32 and "kept (--keep)" in (tmp_path / "secrets.log").read_text()

    # 2. Redis: the embedded default binary with the shipped config (AOF, no eviction: the services check it),
    #    its data directory and port here, and the password requirement
    (tmp_path / "redis-data").mkdir()
    conf = (ROOT / "compose" / "redis" / "redis.conf").read_text()
    assert "\ndir /data\n" in conf  # the volume's mount point, which redis-server checks as it reads the file
    (tmp_path / "redis.conf").write_text(conf.replace("\ndir /data\n", f"\ndir {tmp_path / 'redis-data'}\n"))
    redis = subprocess.Popen([find_redis_server(), str(tmp_path / "redis.conf"), "--port", str(ports["REDIS_PORT"]),
                              "--bind", "127.0.0.1", "--requirepass", password],
                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    procs: dict[str, subprocess.Popen] = {}
    try:
        connect(f"redis://:{password}@127.0.0.1:{ports['REDIS_PORT']}/0", 10, log_retries=False).ping()
        # 3. trainer and samplers, each from its compose command line and environment
        for name in ("trainer", "sampler-0", "sampler-1"):
            procs[name] = start(name, tmp_path / f"{name}.log")
        assert procs["trainer"].wait(600) == 0, (tmp_path / "trainer.log").read_text()[-5000:]
        for name in ("sampler-0", "sampler-1"):
            assert procs[name].wait(120) == 0, (tmp_path / f"{name}.log").read_text()[-5000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        redis.terminate()
        redis.wait(10)

    run_dir = pathlib.Path(mounts.table(services["trainer"])["/runs"]) / "compose"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["groups_trained"] >= STEPS
    assert summary["groups_dropped_invalid"] == 0
    for index in (0, 1):
        sampler = json.loads((run_dir / f"sampler-{index}.json").read_text())
        assert sampler["groups"] > 0
        assert sampler["versions"][-1] == STEPS  # the final version reached every sampler
        assert sampler["final_weights"]["sha256"] == summary["final_weights"]["sha256"]
