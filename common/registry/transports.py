"""Every weight transport by its config name (weights.transport). Adding one: a module with make_sink/make_source
(common/weights/transport.py) and a line here. Nothing else in the code base names a transport."""

from __future__ import annotations

import dataclasses

from grpo_stream.common.registry.base import Registry


@dataclasses.dataclass(frozen=True)
class TransportSpec:
    """What the rest of the system needs to know about a transport without importing it."""
    module: str                # defines make_sink(SinkContext) and make_source(SourceContext)
    in_process: bool = False   # trainer and samplers share one JAX process: `up` runs `colocated`
    needs_dir: bool = False    # reads and writes weights.checkpoint_dir (`up` gives RUN_DIR/weights)
    trainer_serves: bool = False  # the trainer serves the bytes (FetchSlices, and the TCP data plane if asked)


TRANSPORTS: Registry[TransportSpec] = Registry("weights.transport", "transport", {
    # samplers fetch the slices their devices need from the trainer (gRPC, or its TCP data plane)
    "grpc": TransportSpec("grpo_stream.common.weights.grpc_transport", trainer_serves=True),
    # Orbax saves to a directory every sampler can read (shared disk, gs://); samplers restore into their sharding
    "checkpoint": TransportSpec("grpo_stream.common.weights.checkpoint_transport", needs_dir=True),
    # trainer and samplers in one JAX process: jax.device_put from the trainer's arrays
    "local": TransportSpec("grpo_stream.common.weights.local_transport", in_process=True),
})
transport_spec = TRANSPORTS.lookup
