"""The deployment files as a user meets them: the commands their headers tell a user to type, typed as a shell
types them (bash expands a `~` only at the start of a word or after the `=` of a shell assignment, never inside a
dotted override), and the numbers the code holds about them. (The files themselves: test_deploy_files.py.)"""

import os
import pathlib
import re
import subprocess
import sys

import yaml

from grpo_stream.common.config.access import REDIS_PASSWORD_ENV
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rollouts.redis_server import credentials
from tests.conftest import ROOT

COMPOSE = ROOT / "compose"


def header_commands(path) -> list[str]:
    """The command lines of a file's header comment (`#   command  # note`), notes left out."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("#   "):
            lines.append(line[4:].split("  #")[0].strip())
    return lines


def as_bash_passes_them(words: str, home) -> list[str]:
    """The arguments bash hands a program for `words`, with $HOME at `home`."""
    proc = subprocess.run(["bash", "-c", f"printf '%s\\n' {words}"], env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30, check=True)
    return proc.stdout.splitlines()


def test_redis_compose_files_header_reaches_its_redis_with_the_password_it_made(tmp_path, monkeypatch):
    """compose/redis.yml's header: the `tokens` line writes the password, the overrides line points the services
    at it. `redis.auth.password_file=~/...` reached the process with the `~` unexpanded (bash expands a tilde inside
    a word only after the `=` of a variable assignment, and a dotted key is no variable name), and the read failed:
    `redis.auth.password_file=~/.grpo-secrets/redis.password: cannot read it (No such file or directory)`."""
    monkeypatch.delenv(REDIS_PASSWORD_ENV, raising=False)  # it would win over the file
    commands = header_commands(COMPOSE / "redis.yml")
    make = next(c for c in commands if c.startswith("grpo-stream tokens "))
    overrides = next(c for c in commands if c.startswith("redis.url="))
    argv = as_bash_passes_them(make.removeprefix("grpo-stream "), tmp_path)
    made = subprocess.run([sys.executable, "-m", "grpo_stream", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    out = pathlib.Path(argv[argv.index("--out") + 1]).resolve()
    password = (out / "redis.password").read_text().strip()
    # the compose file mounts GRPO_SECRETS_DIR as /secrets: the directory the tokens line wrote
    up = next(c for c in commands if "docker compose -f compose/redis.yml" in c)
    assignment = up.split()[0]
    assert assignment.startswith("GRPO_SECRETS_DIR=")
    secrets_dir = subprocess.run(["bash", "-c", f"{assignment}; printf '%s' \"$GRPO_SECRETS_DIR\""],
                                 env={"HOME": str(tmp_path)}, capture_output=True, text=True, timeout=30).stdout
    assert pathlib.Path(secrets_dir).resolve() == out
    service = yaml.safe_load((COMPOSE / "redis.yml").read_text())["services"]["redis"]
    assert any(v.startswith("${GRPO_SECRETS_DIR") and v.endswith(":/secrets:ro") for v in service["volumes"])
    cfg = load_config(None, as_bash_passes_them(overrides, tmp_path))
    assert cfg.redis.url == "redis://127.0.0.1:6379/0" and service["ports"] == ["127.0.0.1:6379:6379"]
    assert credentials(cfg.redis)["password"] == password


def test_devices_compose_knows_how_many_sampler_services_the_compose_file_has():
    """`grpo-stream devices --compose` refuses a layout of more samplers than the file's services by a number it
    holds (COMPOSE_SAMPLERS): it, the sampler-<i> services and the tokens the `secrets` service makes agree."""
    from grpo_stream.plan.devices import COMPOSE_SAMPLERS  # noqa: PLC0415

    services = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    samplers = sorted(name for name in services if name.startswith("sampler-"))
    assert samplers == [f"sampler-{i}" for i in range(COMPOSE_SAMPLERS)]
    made = services["secrets"]["command"].split()
    assert int(made[made.index("--samplers") + 1]) == COMPOSE_SAMPLERS
    for i, name in enumerate(samplers):
        assert f"--index {i} " in services[name]["command"], name
        assert services[name]["environment"]["GRPO_STREAM_TOKEN_FILE"] == f"/secrets/{name}.token"


def test_the_coordinator_port_the_texts_name_is_the_one_jax_opens_on_a_gke_tpu_slice(monkeypatch):
    """trainer-multihost.yaml, docs/security.md and docs/tpu.md had users keep the JAX coordinator's port, 8476, inside
    the trainer's pods with a NetworkPolicy; on a GKE TPU slice jax.distributed's detection (what
    distributed.initialize=auto calls there) opens it on 8482 (jax's cloud_tpu_cluster.coordinator_port; 8476 is
    TPU_PROCESS_PORT in scripts/tpu-vllm-smoke.sh), so a policy written from them left the real port open, or a
    default-deny one closed it. The manifest sets JAX_COORDINATOR_PORT, and the texts name the port jax derives from
    the pods' environment."""
    from jax._src.clusters import ClusterEnv, cloud_tpu_cluster  # noqa: PLC0415

    manifest = COMPOSE / "k8s" / "trainer-multihost.yaml"
    jobsets = {d["metadata"]["name"]: d for d in yaml.safe_load_all(manifest.read_text())
               if d and d["kind"] == "JobSet"}
    job = jobsets["grpo-mh-trainer"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    env = {e["name"]: e["value"] for e in job["template"]["spec"]["containers"][0]["env"] if "value" in e}
    assert "JAX_COORDINATOR_PORT" in env  # the port the policy must name, not left to a jax release's default
    for name in [k for k in os.environ if k.startswith(("JAX_", "TPU_", "MEGASCALE_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    # what GKE injects into the pods of a 2-host slice
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", ",".join(f"grpo-mh-trainer-{i}" for i in range(job["parallelism"])))
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    # no GCE metadata server or pod DNS here
    monkeypatch.setattr(cloud_tpu_cluster, "get_tpu_env_value_from_metadata", lambda key: None)
    monkeypatch.setattr(cloud_tpu_cluster.GkeTpuCluster, "wait_for_coordinator", staticmethod(lambda *a: None))
    address, processes, process_id, _ = ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None,
                                                                                         "gketpu", 10)
    host, port = address.rsplit(":", 1)
    assert (host, processes, process_id) == ("grpo-mh-trainer-0", job["parallelism"], 1)
    # every port number in a sentence about the coordinator (the manifest's comments; a file mode such as 0400 is none)
    for path in (manifest, ROOT / "docs" / "security.md", ROOT / "docs" / "tpu.md", ROOT / "docs" / "multi-host.md"):
        lines = path.read_text().splitlines()
        if path == manifest:
            lines = [line.split("#", 1)[1] for line in lines if "#" in line]
        prose = " ".join(lines)
        sentences = [s for s in re.split(r"(?<=\.)\s+", prose) if "coordinator" in s.lower()]
        named = {n for s in sentences for n in re.findall(r"(?<![\d.])([1-9]\d{3,4})(?![\d.])", s)}
        assert named == {port}, (path.name, named, port)
