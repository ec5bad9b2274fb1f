"""A sampler started with another model than the trainer's stops at once with the reason (issue 42).

A real trainer server (ingest on a real Redis, WeightService, health, tokens) publishes the tiny model with
model.tiny.hidden_dim=64; a real sampler (`run_sampler`: engine, channels, sender thread, /metrics) is started with
hidden_dim=128, as a sampler given another model.path would be. Its first weight check raises a PermanentError naming
the parameter and both shapes, within seconds rather than warning for ever, and everything it started is stopped on
the way out. As a process (`grpo-stream sampler`) it exits non-zero with that message (the exit code that means
"permanent" is the CLI's policy, tested with the CLI).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.runtime.process import STOP_SIGNALS
from grpo_stream.common.weights.snapshot import WeightSnapshot
from grpo_stream.sampler_service.loop import run_sampler
from tests.conftest import CONFIGS, ROOT
from tests.support import serve, wait_for

pytestmark = pytest.mark.redis
CONFIG = CONFIGS / "tiny_arith_smoke.yaml"
SHAPES = "layers.0.mlp.down_proj.kernel is (64, 32) there and (128, 32) here"  # the trainer's, then the sampler's


@pytest.fixture
def trainer(shared_redis, run_name, tmp_path):
    """A trainer server that has published version 0 of the hidden_dim=64 model; yields (stack, the overrides a
    sampler of this run takes)."""
    cfg = load_config(CONFIG, [f"run.name={run_name}", "model.tiny.hidden_dim=64"])
    task, tokenizer = build_task_and_tokenizer(cfg)
    with serve(cfg, shared_redis.url, tmp_path / "auth", task, tokenizer, publish=False) as stack:
        model = build_policy(cfg, tokenizer.vocab_size, seed=0)
        stack.publisher.publish(WeightSnapshot(0, model.to_named_numpy()))
        overrides = [f"run.name={run_name}", f"sampler.trainer_address={stack.address}",
                     f"auth.token_file={stack.tokens['sampler']}", "sampler.metrics_port=0",
                     "sampler.connect_timeout_s=30"]
        yield stack, overrides


@pytest.fixture
def restore_signal_handlers():
    """run_sampler installs the process's stop handlers; put pytest's back."""
    saved = {name: signal.getsignal(getattr(signal, name)) for name in STOP_SIGNALS}
    yield
    for name, handler in saved.items():
        signal.signal(getattr(signal, name), handler)


def test_a_sampler_of_another_model_raises_a_permanent_error_naming_both_shapes(trainer, tmp_path,
                                                                                restore_signal_handlers):
    stack, overrides = trainer
    cfg = load_config(CONFIG, [*overrides, "model.tiny.hidden_dim=128"])
    before = set(threading.enumerate())
    started = time.monotonic()
    with pytest.raises(PermanentError) as err:
        run_sampler(cfg, 0, tmp_path)
    assert time.monotonic() - started < 60
    message = str(err.value)
    assert message.startswith("weights version 0 from the trainer do not fit this sampler's model: ")
    assert SHAPES in message and "start the sampler with the trainer's model settings" in message, message
    assert "this sampler has model.kind=tiny, model.tiny vocab_size=160" in message and "hidden_dim=128" in message
    # what it started is stopped (idle pool threads end a moment after their shutdown): the rollout sender and its
    # ack watch, the fetch threads, the group sink's thread (left running when the first weight check failed);
    # nothing generated, nothing installed
    def ours_left():
        return [t.name for t in set(threading.enumerate()) - before
                if t.is_alive() and t.name.startswith(("rollout-", "fetch", "weight-fetch", "sampler-0-"))]

    wait_for(lambda: not ours_left(), 10, "the sampler's threads to end")
    assert stack.publisher.samplers.installed.get("sampler-0", []) == []
    assert not (tmp_path / "sampler-0.json").exists()


def test_the_sampler_process_exits_non_zero_with_the_reason(trainer, tmp_path):
    _, overrides = trainer
    command = [sys.executable, "-m", "grpo_stream", "sampler", "--config", str(CONFIG), "--index", "0",
               "--run-dir", str(tmp_path), *overrides, "model.tiny.hidden_dim=128"]
    started = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    took = time.monotonic() - started
    assert proc.returncode not in (0, None), proc.stderr[-3000:]
    assert SHAPES in proc.stderr, proc.stderr[-3000:]
    assert took < 60 + 30, took  # 60 s for the sampler; the rest for a cold interpreter importing JAX


def test_a_sampler_that_stops_gives_its_admission_grants_back(trainer, tmp_path):
    """Grants a stopped sampler held counted as in flight for sampler.admission_lease_s (600 s): where they filled the
    staleness bound, every other sampler was refused and the trainer waited for groups nobody could start."""
    from grpo_stream.sampler_service.lifecycle import open_sampler

    stack, overrides = trainer
    cfg = load_config(CONFIG, overrides)
    control = stack.server.ingest.admission
    with open_sampler(cfg, 0, "sampler-0", threading.Event()) as parts:
        granted = parts.admission.admit(2, 0, 0)
        assert granted == 2 and control.in_flight()["sampler-0"] == 2
    assert control.in_flight().get("sampler-0", 0) == 0
