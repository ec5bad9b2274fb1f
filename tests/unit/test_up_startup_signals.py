"""A stop signal while `up` starts (waiting for its Redis, preparing the run) ends it as Ctrl-C does: exit 130,
saying so. SIGTERM (systemd's and Kubernetes' stop) and SIGHUP killed it silently with 143 and 129."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.unit.readme import ROOT


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_while_up_waits_for_its_redis_exits_130_saying_so(tmp_path, signum):
    proc = subprocess.Popen([sys.executable, "-m", "grpo_stream", "up", "--config", "configs/tiny_arith_smoke.yaml",
                             "--run-dir", str(tmp_path / "run"), "redis.url=redis://127.0.0.1:1/0"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        for line in proc.stdout:  # until it retries the Redis it cannot reach: inside the start, before any process
            lines.append(line)
            if "not reachable" in line:
                break
        assert "not reachable" in "".join(lines), "".join(lines)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert "grpo-stream up: interrupted" in err
    finally:
        proc.kill()
        proc.wait()
