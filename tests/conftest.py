"""Shared fixtures: real Redis servers on free ports, a small run config, tiny model pieces."""

from __future__ import annotations

import pathlib

import pytest

from common.config import load_config
from common.redis_util import EmbeddedRedis

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"

_CACHE_TMP = pytest.StashKey[str]()


def pytest_configure(config):
    """One persistent JAX compilation cache for the whole run ($GRPO_STREAM_TEST_CACHE_DIR, else a fresh temporary
    directory): every process the tests start inherits it through the environment, and this process uses it too,
    so each program compiles once per run, not once per test process."""
    import os
    import tempfile

    from common.config import COMPILATION_CACHE_ENV
    from common.runtime import enable_compilation_cache

    directory = os.environ.get("GRPO_STREAM_TEST_CACHE_DIR")
    if not directory:
        directory = config.stash[_CACHE_TMP] = tempfile.mkdtemp(prefix="grpo-stream-test-jax-cache-")
    os.environ[COMPILATION_CACHE_ENV] = os.path.abspath(directory)
    enable_compilation_cache(load_config(None))


def pytest_unconfigure(config):
    import shutil

    if config.stash.get(_CACHE_TMP, None):
        shutil.rmtree(config.stash[_CACHE_TMP], ignore_errors=True)


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
