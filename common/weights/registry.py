"""Every weight transport by its config name (weights.transport). Adding one: a module with make_sink/make_source
(see transport.py) and a line here. Nothing else in the code base names a transport."""

from __future__ import annotations

import importlib

from grpo_stream.common.weights.transport import SinkContext, SourceContext, TransportSpec, WeightSink, WeightSource

TRANSPORTS: dict[str, TransportSpec] = {
    # samplers fetch the slices their devices need from the trainer (gRPC, or its TCP data plane)
    "grpc": TransportSpec("grpo_stream.common.weights.grpc_transport", trainer_serves=True),
    # Orbax saves to a directory every sampler can read (shared disk, gs://); samplers restore into their sharding
    "checkpoint": TransportSpec("grpo_stream.common.weights.checkpoint_transport", needs_dir=True),
    # trainer and samplers in one JAX process: jax.device_put from the trainer's arrays
    "local": TransportSpec("grpo_stream.common.weights.local_transport", in_process=True),
}


def transport_spec(name: str) -> TransportSpec:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"weights.transport={name!r}: unknown; choose one of {sorted(TRANSPORTS)}") from None


def weight_sink(name: str, ctx: SinkContext) -> WeightSink:
    return importlib.import_module(transport_spec(name).module).make_sink(ctx)


def weight_source(name: str, ctx: SourceContext) -> WeightSource:
    return importlib.import_module(transport_spec(name).module).make_source(ctx)
