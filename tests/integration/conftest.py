"""Fixtures of the integration tests that several modules share."""

import pytest

from grpo_stream.common.rpc.auth import write_tokens
from tests.support import serve, with_run_name


@pytest.fixture
def per_sampler_stack(tiny_parts, shared_redis, run_name, tmp_path):
    """A served stack whose token table has a token per sampler (sampler-0, sampler-1): tests of what one sampler's
    token may do to the other's groups."""
    cfg, task, tokenizer, _ = tiny_parts
    paths = write_tokens(tmp_path / "table", samplers=2)
    cfg = with_run_name(cfg, run_name)
    cfg = cfg.model_copy(update={"auth": cfg.auth.model_copy(update={"tokens_file": str(paths["table"])})})
    with serve(cfg, shared_redis.url, tmp_path / "unused", task, tokenizer) as stack:
        stack.tokens = paths
        yield stack
