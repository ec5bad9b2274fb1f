"""How the deployment files restart a failed grpo-stream process. Every entry point exits 2 (usage or config error)
or 3 (a permanent failure) when a restart cannot help (common/runtime/errors.py), and `up` stops there; a
container platform cannot tell those from a crash, so the files must bound the restarts they leave to it and, where
the platform can read exit codes (Kubernetes' podFailurePolicy), stop at once on those two."""

import re

import yaml

from grpo_stream.common.runtime.errors import EXIT_PERMANENT, EXIT_USAGE
from tests.conftest import ROOT

COMPOSE = ROOT / "compose"
PERMANENT_EXITS = {EXIT_USAGE, EXIT_PERMANENT}


def grpo_commands(services: dict) -> dict[str, dict]:
    """The compose services that run a long-lived grpo-stream process (the one-shot `secrets` step aside)."""
    out = {}
    for name, service in services.items():
        command = service.get("command", "")
        words = command.split() if isinstance(command, str) else list(command)
        if words[:1] == ["grpo-stream"] and words[1] in ("trainer", "sampler", "ingest"):
            out[name] = service
    return out


def test_compose_bounds_the_restarts_of_a_failed_trainer_or_sampler():
    """`restart: on-failure` had Docker restart a trainer or sampler that exited 2 or 3 for ever (a mistyped
    RUN_OVERRIDES key, a run directory of another config, a checkpoint of another model), once a minute, and an
    attached `docker compose up` never ended. Docker's on-failure counts every exit but 0 and never resets the count
    while the container lives (moby's restartmanager), so a bound is the one way to stop such a loop."""
    services = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())["services"]
    processes = grpo_commands(services)
    assert {"trainer", "sampler-0", "sampler-1", "sampler-2"} <= set(processes)
    for name, service in processes.items():
        policy = str(service.get("restart", "no"))
        match = re.fullmatch(r"on-failure:(\d+)", policy)
        assert match and 1 <= int(match.group(1)) <= 10, (name, policy)
    # the one-shot step is never restarted (a failed `tokens` is a wrong volume, not a crash)
    assert services["secrets"].get("restart", "no") == "no"


def pod_specs(jobset: dict) -> dict[str, dict]:
    return {job["name"]: job["template"]["spec"] for job in jobset["spec"]["replicatedJobs"]}


def test_kubernetes_jobs_fail_at_once_on_a_permanent_exit():
    """The JobSets restarted a trainer or sampler that exited 2 or 3 as they restart a crash: the job's pods up to
    backoffLimit times, then the whole JobSet (every TPU slice rescheduled) up to failurePolicy.maxRestarts times,
    each attempt meeting the same wall. Each grpo-stream job now fails on those exits (podFailurePolicy, which needs
    restartPolicy Never), and a job failed that way fails its JobSet instead of restarting it."""
    for path in sorted((COMPOSE / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] != "JobSet":
                continue
            where = f"{path.name}: {doc['metadata']['name']}"
            for name, job in pod_specs(doc).items():
                pod = job["template"]["spec"]
                container = pod["containers"][0]
                assert container["command"][0] == "grpo-stream", (where, name)
                assert pod["restartPolicy"] == "Never", (where, name)  # podFailurePolicy's condition
                rules = job.get("podFailurePolicy", {}).get("rules", [])
                failing = [r for r in rules if r["action"] == "FailJob" and "onExitCodes" in r]
                assert failing, (where, name, "no FailJob rule on exit codes")
                codes = failing[0]["onExitCodes"]
                assert codes["operator"] == "In" and set(codes["values"]) == PERMANENT_EXITS, (where, name, codes)
                assert codes.get("containerName", container["name"]) == container["name"], (where, name)
            policy = doc["spec"].get("failurePolicy")
            if policy is None:  # no restarts at all: a failed job fails the JobSet
                continue
            assert any(r["action"] == "FailJobSet" and r.get("onJobFailureReasons") == ["PodFailurePolicy"]
                       and not r.get("targetReplicatedJobs") for r in policy.get("rules", [])), (where, policy)


def test_the_jobset_schema_checks_failure_policy_rules():
    """The offline JobSet schema took any object as a failure policy rule; a misspelt action or job failure reason
    (which the controller would refuse, or never match) now fails validation as Kubernetes' own fields do."""
    import jsonschema  # noqa: PLC0415

    from tests.unit.test_deploy_files import k8s_documents, validate_k8s  # noqa: PLC0415

    for breakage in ({"action": "FailJobset"}, {"onJobFailureReasons": ["PodFailurePolicies"]}, {"name": "1st"},
                     {"onExitCodes": [2, 3]}):
        doc = next(d for d in k8s_documents() if d["kind"] == "JobSet" and d["spec"].get("failurePolicy"))
        doc["spec"]["failurePolicy"]["rules"][0].update(breakage)
        try:
            validate_k8s(doc)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"a rule with {breakage} validated")


def dockerignored(relative: str) -> bool:
    """Whether .dockerignore leaves `relative` (a path in the build context, the repository) out: a pattern that
    names it or a folder above it, at the root or, with a leading `**/`, at any depth."""
    import fnmatch  # noqa: PLC0415

    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    parts = relative.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatchcase(part, pattern[3:]) for part in parts):
                return True
        elif any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
            return True
    return False


def test_compose_mounts_no_host_folder_the_image_build_would_send():
    """compose/.env.example's MODELS_DIR=./models is compose/models (compose resolves a relative path from the compose
    file's folder), inside the build context and not in .dockerignore, which leaves out only the repository's own
    models/ (where `grpo-stream fixture` writes): checkpoints put there went to the builder with every
    `docker compose up --build` (the legacy builder sends the whole context). Every host folder the file mounts with
    the example's settings is outside the repository or left out of the build."""
    import pathlib  # noqa: PLC0415

    env = dict(line.split("=", 1) for line in (COMPOSE / ".env.example").read_text().splitlines()
               if "=" in line and not line.startswith("#"))
    text = (COMPOSE / "docker-compose.yml").read_text()
    sources = set()
    for name, default in re.findall(r"\$\{(\w+):-([^}]*)\}:/\w+:ro", text):
        for value in (env[name], default):  # the example's value and the file's own default
            sources.add(value)
    assert {"MODELS_DIR", "DATA_DIR"} <= {n for n, _ in re.findall(r"\$\{(\w+):-([^}]*)\}:/\w+:ro", text)}
    for source in sorted(sources):
        host = pathlib.Path(COMPOSE, source).resolve()
        if host.is_relative_to(ROOT.resolve()):
            relative = host.relative_to(ROOT.resolve()).as_posix()
            assert dockerignored(relative), f"{source} ({relative}) is sent to the image builder"
    assert dockerignored("models") and dockerignored("secrets") and not dockerignored("configs")
