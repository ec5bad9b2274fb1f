"""A sampler waiting for the trainer's first weights is alive, not stalled (up.sampler_stall_s), and one stopped then
ends cleanly.

The trainer publishes version 0 only after its warm start and eval_before (minutes to hours on a real model). The
sampler waits for it as long as the trainer answers, but it beat no heartbeat meanwhile, so `up` read the wait as a
hang and killed and restarted it every up.sampler_stall_s (a run with a shorter setting stopped on the crash-loop
budget). A real trainer server that answers its health check and has published nothing; a real sampler
(`Sampler.run`: engine, channels, sender thread) waits for it, beats, and stops cleanly on a stop request.

A sampler of its own (`grpo-stream sampler --run-dir D`) made D only with its first heartbeat: one stopped before
(the trainer not reachable yet) failed writing D/sampler-<i>.json, and exited 1 instead of 0 after a clean stop.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.assembly.parts import build_task_and_tokenizer
from grpo_stream.common.runtime.heartbeat import beat_path
from grpo_stream.sampler_service.loop import Sampler
from tests.conftest import CONFIGS, ROOT
from tests.support import serve, wait_for

CONFIG = CONFIGS / "tiny_arith_smoke.yaml"


@pytest.mark.redis
def test_a_sampler_waiting_for_the_first_weights_beats_its_heartbeat(shared_redis, run_name, tmp_path):
    cfg = load_config(CONFIG, [f"run.name={run_name}"])
    task, tokenizer = build_task_and_tokenizer(cfg)
    with serve(cfg, shared_redis.url, tmp_path / "auth", task, tokenizer, publish=False) as stack:
        cfg = load_config(CONFIG, [f"run.name={run_name}", f"sampler.trainer_address={stack.address}",
                                   f"auth.token_file={stack.tokens['sampler']}", "sampler.metrics_port=null"])
        run_dir = tmp_path / "run"
        sampler = Sampler(cfg, 0, run_dir=run_dir)
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(sampler.run()), daemon=True)
        thread.start()
        try:
            wait_for(lambda: sampler.weights.sync is not None, 120, "the sampler to reach the trainer")
            heartbeat = beat_path(run_dir, "sampler-0")
            wait_for(heartbeat.exists, 60, "a heartbeat while the sampler waits for the first weights")
            assert sampler.weights.params is None  # still waiting: nothing was published
        finally:
            sampler.stop_event.set()
            thread.join(60)
        assert not thread.is_alive(), "the sampler did not stop"
        assert result["versions"] == [] and result["groups"] == 0


def test_a_sampler_stopped_before_its_first_weights_writes_its_summary_into_a_new_run_dir(tmp_path):
    # a port held bound but not listening for the test's length: the trainer is not up yet (a port only picked and
    # let go may be some other process's server by the time the sampler dials it)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        cfg = load_config(CONFIG, [f"sampler.trainer_address={address}", "auth.mode=none",
                                   "sampler.metrics_port=null"])
        run_dir = tmp_path / "not" / "made"
        sampler = Sampler(cfg, 0, run_dir=run_dir)
        sampler.stop_event.set()  # SIGTERM while it waits for the trainer
        result = sampler.run()
    assert result["versions"] == [] and result["groups"] == 0
    assert json.loads((run_dir / "sampler-0.json").read_text())["sampler_id"] == "sampler-0"


def jax_loading(pid: int) -> bool:
    """JAX's compiled core is mapped: the process is importing JAX (seconds before its loop can handle a signal)."""
    try:
        return "jaxlib/_jax" in pathlib.Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_a_sampler_stopped_while_it_imports_jax_exits_0_with_its_summary(tmp_path):
    """`up` stopped (Ctrl-C, SIGHUP) while a sampler was still starting: SIGTERM's default killed it (-15 in
    summary.json) where a sampler stopped a second later exited 0. The stop is now held from the process's start
    and the sampler stops as its loop starts."""
    with socket.socket() as sock:  # the trainer not up yet (as in the test above)
        sock.bind(("127.0.0.1", 0))
        run_dir = tmp_path / "run"
        proc = subprocess.Popen([sys.executable, "-m", "grpo_stream", "sampler", "--config", str(CONFIG), "--index",
                                 "0", "--run-dir", str(run_dir), f"sampler.trainer_address=127.0.0.1:"
                                 f"{sock.getsockname()[1]}", "auth.mode=none", "sampler.metrics_port=null"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_for(lambda: jax_loading(proc.pid) or proc.poll() is not None, 120, "the sampler to import JAX",
                     interval_s=0.005)
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert "a stop signal came while the process started" in output, output[-3000:]
    assert json.loads((run_dir / "sampler-0.json").read_text())["groups"] == 0
