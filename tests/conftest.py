"""Shared fixtures: real Redis servers on free ports, a small run config, tiny model pieces."""

from __future__ import annotations

import pathlib
import uuid

import pytest

from common.config import load_config
from common.redis_util import EmbeddedRedis

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


@pytest.fixture
def redis_server():
    """A private redis-server for one test (started and stopped by the test): for tests that stop, kill or
    reconfigure Redis. Every other test takes `shared_redis` and its own `run_name`."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_redis():
    """One redis-server for the whole test run. A test on it keeps to its own run name (`run_name`): the buffer's
    and the prompt queue's keys all live under grpo-stream:<run name>:, so tests never see each other's data.
    Never stop, kill, flush or reconfigure it (take `redis_server` for that), nor count keys across runs."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def new_run_name():
    """Makes run names no other test uses, for keys on `shared_redis` (module-scoped fixtures call it)."""
    return lambda: f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def run_name(new_run_name) -> str:
    """This test's own run name."""
    return new_run_name()


@pytest.fixture(scope="session")
def small_cfg():
    """The demo config shrunk for tests: small model, short sequences."""
    return load_config(CONFIGS / "tiny_arith.yaml", [
        "model.tiny.embed_dim=32", "model.tiny.hidden_dim=64", "model.tiny.head_dim=8",
        "generation.num_generations=4", "eval.num_problems=16", "eval.batch_size=16",
    ])


@pytest.fixture(scope="session")
def tiny_parts(small_cfg):
    """(cfg, task, tokenizer, model) built once per session."""
    from common.model import build_model
    from common.runtime import build_task, build_tokenizer

    task = build_task(small_cfg)
    tokenizer = build_tokenizer(small_cfg, task)
    model = build_model(small_cfg.model, tokenizer.vocab_size, seed=0)
    return small_cfg, task, tokenizer, model
