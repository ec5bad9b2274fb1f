"""The weight transport of a run: the one its config names (weights.transport) in common/registry/transports.py."""

from __future__ import annotations

from grpo_stream.common.registry.transports import TRANSPORTS
from grpo_stream.common.weights.transport import SinkContext, SourceContext, WeightSink, WeightSource


def weight_sink(name: str, ctx: SinkContext) -> WeightSink:
    return TRANSPORTS.load(name, "make_sink")(ctx)


def weight_source(name: str, ctx: SourceContext) -> WeightSource:
    return TRANSPORTS.load(name, "make_source")(ctx)
