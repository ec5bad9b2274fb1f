"""The Redis `grpo-stream up` embeds, attacked while a real run goes on (issue 41, finding 1): another user of the
host reads every command line (`ps`) and can connect to any loopback port. The password is in no command line and in
no sampler's environment, a client without it is refused, CONFIG is unknown even with it, and the run and its audit
(a separate process, which finds the password in the run's Redis directory) go on as before."""

import os
import pathlib
import re
import subprocess
import sys
import threading

import pytest
import redis

from grpo_stream.common.config.access import REDIS_PASSWORD_ENV
from grpo_stream.common.rollouts.redis_protection import read_password
from tests.support import stop_process, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.redis, pytest.mark.slow]


def processes() -> dict[int, tuple[bytes, bytes]]:
    """pid -> (argv, environment) of every process this user can read."""
    out = {}
    for entry in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            out[int(entry.name)] = ((entry / "cmdline").read_bytes(), (entry / "environ").read_bytes())
        except OSError:  # gone, or another user's
            continue
    return out


def test_the_runs_redis_needs_its_password_which_no_command_line_shows(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "grpo_stream", "up", "--config", "configs/tiny_arith_smoke.yaml",
                             "--run-dir", str(run_dir), "trainer.steps=12"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: proc.poll() is None and any("[trainer]" in line and " step " in line for line in lines),
                 300, "the run's first step")
        url = re.search(r"\[up\] embedded Redis at (redis://\S+) \(Redis \d", "".join(lines)).group(1)
        password = read_password(run_dir / "redis")
        assert password, "the run's Redis has no password: any local user's client is served"
        seen = processes()
        ours = {pid: (args, env) for pid, (args, env) in seen.items() if str(run_dir).encode() in args}
        samplers = [env for args, env in ours.values() if b"\0sampler\0" in args]
        trainers = [env for args, env in ours.values() if b"\0trainer\0" in args]
        assert len(samplers) == 2 and len(trainers) == 1, [a for a, _ in ours.values()]
        assert not [args for args, _ in seen.values() if password.encode() in args]  # in no command line at all
        assert all(f"{REDIS_PASSWORD_ENV}=".encode() not in env for env in samplers)  # samplers never use Redis
        assert f"{REDIS_PASSWORD_ENV}={password}".encode() in trainers[0]  # as the URL reaches it: from `up`
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(url).keys("*")
        holder = redis.Redis.from_url(url, password=password)
        for command in (("CONFIG", "SET", "appendfsync", "no"), ("CONFIG", "SET", "dir", str(tmp_path)), ("SAVE",)):
            with pytest.raises(redis.ResponseError, match="(?i)unknown command"):
                holder.execute_command(*command)
        assert proc.wait(timeout=300) == 0, "".join(lines)[-4000:]
    finally:
        stop_process(proc)
        reader.join(timeout=10)
    audit = subprocess.run([sys.executable, "-m", "grpo_stream", "audit", str(run_dir)], cwd=ROOT, text=True,
                           capture_output=True, timeout=120, env={k: v for k, v in os.environ.items()
                                                                  if k != REDIS_PASSWORD_ENV})
    assert audit.returncode == 0 and "OK; written to" in audit.stdout, audit.stderr[-3000:]
