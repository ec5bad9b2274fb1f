"""The generation engine a sampler runs: the one its config names (sampler.engine) in common/registry/engines.py."""

from __future__ import annotations

from grpo_stream.common.engine.base import GenerationEngine
from grpo_stream.common.registry.engines import ENGINES


def build_engine(cfg, model, tokenizer, index: int = 0) -> GenerationEngine:
    """The engine sampler `index` generates with; `model` is its (abstract) policy model, whose parameter names
    and architecture the published weights follow."""
    return ENGINES.load(cfg.sampler.engine, "build")(cfg, model, tokenizer, index)
