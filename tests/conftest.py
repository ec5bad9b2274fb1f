"""Shared fixtures: real Redis servers on free ports, a small run config, tiny model pieces."""

from __future__ import annotations

import pathlib

import pytest

from common.config import load_config
from common.redis_util import EmbeddedRedis

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


@pytest.fixture
def redis_server():
    """A private redis-server for one test (started and stopped by the test)."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.stop()


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
