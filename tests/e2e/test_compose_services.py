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

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.redis_server import connect, find_redis_server, free_port
from grpo_stream.plan.device_plan import plan_devices
from grpo_stream.plan.devices import compose_env
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


def gpu_settings(service: dict) -> dict:
    env = service["environment"]
    return {k: str(env[k]) for k in ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                     "XLA_PYTHON_CLIENT_MEM_FRACTION")}


def dockerfile_stages(name: str) -> dict[str, str]:
    """Stage name -> its text, of compose/Dockerfile.<name>."""
    stages, current = {}, None
    for line in (ROOT / "compose" / f"Dockerfile.{name}").read_text().splitlines():
        words = line.split()
        if len(words) >= 4 and words[0] == "FROM" and words[2].upper() == "AS":
            current = words[3]
            stages[current] = ""
        if current:
            stages[current] += line + "\n"
    return stages


def test_compose_runs_on_a_one_gpu_host_by_default():
    proc = subprocess.run([compose_binary(), "-f", str(COMPOSE_FILE), "--env-file",
                           str(ROOT / "compose" / ".env.example"), "config", "-q"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    services = resolved(ROOT / "compose" / ".env.example")["services"]
    assert {"secrets", "redis", "trainer", "sampler-0", "sampler-1", "sampler-2", "tensorboard"} <= set(services)
    assert services["tensorboard"]["profiles"] == ["tensorboard"]
    assert "profiles" not in services["sampler-0"] and services["sampler-2"]["profiles"] == ["sampler-2"]
    redis = services["redis"]
    assert any(v.startswith("redis-data:/data") for v in redis["volumes"])
    assert "requirepass" in " ".join(redis["command"])
    for name in ("trainer", "sampler-0", "sampler-1", "sampler-2"):  # no GPU named that a host may lack
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
        assert gpu_settings(services[name])["CUDA_VISIBLE_DEVICES"] == "0"
        assert any(v.startswith("compile-cache:/cache") for v in services[name]["volumes"])
    assert services["sampler-0"]["shm_size"] in ("8gb", "8g", 8 << 30)
    # the defaults are the device plan's for one GPU shared by the trainer and one sampler
    cfg = load_config(ROOT / "configs" / "tiny_arith.yaml", ["sampler.replicas=1"])
    planned = compose_env(cfg, plan_devices(cfg, ["0"]))
    for name, key in (("trainer", "TRAINER"), ("sampler-0", "SAMPLER0")):
        assert gpu_settings(services[name]) == {"CUDA_VISIBLE_DEVICES": planned[f"{key}_GPUS"],
                                                "XLA_PYTHON_CLIENT_PREALLOCATE": planned[f"{key}_GPU_PREALLOCATE"],
                                                "XLA_PYTHON_CLIENT_MEM_FRACTION": planned[f"{key}_GPU_MEM_FRACTION"]}
    assert "--index 0" in services["sampler-0"]["command"] and "sampler.replicas=1" in services["sampler-0"]["command"]


@pytest.mark.parametrize("engine", ["jax", "vllm"])
def test_compose_takes_the_device_plans_settings_for_several_gpus(tmp_path, engine):
    cfg = load_config(ROOT / "configs" / "tiny_arith.yaml", ["sampler.replicas=3", f"sampler.engine={engine}"])
    plan = plan_devices(cfg, ["0", "1", "2"])  # trainer alone on 0, samplers 1, 2, 1
    services = resolved(env_file(tmp_path / "gpus.env", **compose_env(cfg, plan)))["services"]
    cuda = dockerfile_stages("cuda")
    assert "jax[cuda13]" in cuda["jax"] or "cuda.txt" in cuda["jax"]  # the trainer's and JAX samplers' stage
    assert "install-vllm-env.sh" in cuda["vllm"] and re.search(r"\b(g\+\+|gcc|build-essential)\b", cuda["vllm"])
    assert services["trainer"]["build"]["target"] == "jax"
    for i in range(3):
        service, planned = services[f"sampler-{i}"], plan.process(f"sampler-{i}")
        assert service["build"]["target"] == engine and service["image"].endswith(f"-{engine}")
        assert gpu_settings(service)["CUDA_VISIBLE_DEVICES"] == planned.env["CUDA_VISIBLE_DEVICES"]
        assert f"sampler.engine={engine}" in service["command"] and "sampler.replicas=3" in service["command"]
        if engine == "vllm":  # its share as vLLM's own limit
            assert f"sampler.vllm.gpu_memory_utilization={planned.share or 0.5}" in service["command"]
    assert gpu_settings(services["trainer"]) == {"CUDA_VISIBLE_DEVICES": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                                                 "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"}


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
                        SAMPLER_REPLICAS="2", COMPOSE_PROFILES="sampler-1",
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
    samplers = [json.loads((run_dir / f"sampler-{index}.json").read_text()) for index in (0, 1)]
    # what was trained came from the samplers; not from each: a sampler that connects after its retry's back-off
    # can find a 4-step run over (seen 2026-11-30 on a fast machine with warm compilation caches: sampler-1
    # connected 2 s after sampler-0, as step 1 ended, and the run ended 1 s later with 0 groups of its own)
    assert sum(sampler["groups"] for sampler in samplers) >= summary["groups_trained"]
    for sampler in samplers:
        assert sampler["versions"][-1] == STEPS  # the final version reached every sampler
        assert sampler["final_weights"]["sha256"] == summary["final_weights"]["sha256"]


def test_each_sampler_has_its_own_token_and_nothing_is_published_beyond_loopback():
    """Issue 41: one token shared by every sampler lets any of them send as another (common/rpc/auth.py:
    may_act_as), and ports published on every interface carry tokens and rollouts in plaintext."""
    services = resolved(ROOT / "compose" / ".env.example")["services"]
    made = shlex.split(services["secrets"]["command"] if isinstance(services["secrets"]["command"], str)
                       else " ".join(services["secrets"]["command"]))
    samplers = sorted(name for name in services if name.startswith("sampler-"))
    assert int(made[made.index("--samplers") + 1]) >= len(samplers)
    for name in samplers:
        assert services[name]["environment"]["GRPO_STREAM_TOKEN_FILE"] == f"/secrets/{name}.token"
    for name, service in services.items():
        for port in service.get("ports", []):
            host = port.get("host_ip") if isinstance(port, dict) else str(port).rsplit(":", 2)[0]
            assert host == "127.0.0.1", (name, port)
        command = service.get("command") or ""
        assert "0.0.0.0" not in (command if isinstance(command, str) else " ".join(command)), name
    assert "ports" not in services["redis"]


def test_redis_listens_on_the_port_the_services_are_told(tmp_path):
    """REDIS_PORT went into every service's redis.url while the bundled Redis kept listening on 6379."""
    services = resolved(env_file(tmp_path / "test.env", REDIS_PORT="6380"))["services"]
    text = lambda value: value if isinstance(value, str) else " ".join(value)  # noqa: E731 - a string or a list
    assert 'echo "port 6380"' in text(services["redis"]["command"])
    assert "redis-cli -p 6380 ping" in text(services["redis"]["healthcheck"]["test"])
    assert "redis.url=redis://redis:6380/0" in text(services["trainer"]["command"])
