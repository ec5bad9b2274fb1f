"""How published weights travel from the trainer to the samplers, and multi-host JAX start-up."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from grpo_stream.common.config.base import FilePath, Strict
from grpo_stream.common.config.names import TransportName


class WeightsSection(Strict):
    """How published weights travel from the trainer to the samplers (see docs/rollouts-and-weights.md, "Weight
    publication")."""

    transport: TransportName = Field(
        "grpc", description="'grpc': samplers fetch the slices their devices need from the trainer's WeightService "
        "(separate deployments); 'checkpoint': Orbax saves to weights.checkpoint_dir (shared disk or gs://) with a "
        "completion marker, samplers restore into their sharding; 'local': trainer and samplers in one JAX process "
        "(`grpo-stream up` then runs one process), weights move by jax.device_put.")
    wire_dtype: Literal["model", "float32", "bfloat16"] = Field(
        "model", description="Dtype of published tensors: 'model' keeps the trainer's; 'bfloat16' halves the bytes "
        "of a float32 model (samplers cast back to model.dtype).")
    publish_copy: bool = Field(
        True, description="When the trainer's update donates its parameters (every transport but 'local'), each "
        "publication reads a device copy of the trained parameters made as the step ends, so the next update starts "
        "at once instead of waiting until the publication has read them (a large model's device-to-host copy takes "
        "about a second). Costs one copy of the trained parameters (with model.lora the adapters only) in device "
        "memory, which `grpo-stream plan` counts; false: no copy, the next update waits for the publication.")
    data_plane: Literal["tcp", "grpc"] = Field(
        "tcp", description="grpc transport: how slice bytes travel. 'tcp': the trainer also serves them on a plain "
        "TCP port (weights.data_port) without gRPC framing, about twice gRPC's bytes/s (BENCHMARKS.md); samplers "
        "that cannot reach that port fall back to gRPC. 'grpc': FetchSlices streams only (one port to open).")
    data_port: int = Field(0, ge=0, le=65535, description="grpc transport, data_plane tcp: the trainer's data-plane "
                           "port; 0 = a free port (announced to samplers in the manifest). Fix it when a firewall "
                           "or a Kubernetes Service must list it.")
    chunk_bytes: int = Field(4 << 20, ge=64 << 10, le=32 << 20, description="grpc: bytes per streamed chunk.")
    fetch_streams: int = Field(2, ge=1, le=32, description="grpc: parallel FetchSlices streams per fetch from one "
                               "trainer process (a multi-host trainer's processes are each fetched from at once, one "
                               "lane each).")
    max_serve_mb_s: float | None = Field(None, gt=0, le=1e6, description="grpc: cap on the bytes/s of each fetch "
                                         "lane (a fetch uses fetch_streams lanes) as the trainer serves it (leave "
                                         "room for rollout traffic); null = no cap.")
    checkpoint_dir: FilePath = Field(None, description="checkpoint: directory (local, NFS or gs://) that holds "
                                       "published versions; `up` uses RUN_DIR/weights when null.")
    keep_versions: int = Field(3, ge=2, le=10_000, description="checkpoint: versions kept on disk (older are "
                               "deleted; a sampler still restoring one retries with the newest).")
    background_fetch: bool = Field(True, description="Samplers fetch a new version on a background thread while "
                                   "they keep starting groups with the installed one, and install it whole as "
                                   "sampler.weight_updates says; false = the feeder's thread fetches it, and no "
                                   "group starts during the transfer. Either way the engine decodes the groups in "
                                   "flight with the installed version until it takes the new one, so the devices "
                                   "hold a second copy of the weights while a version arrives (`grpo-stream plan`'s "
                                   "fetch buffer).")
    retry_initial_s: float = Field(0.5, gt=0, le=600, description="First back-off after a failed fetch; doubles "
                                   "per failure.")
    retry_max_s: float = Field(10.0, gt=0, le=3600, description="Longest back-off between fetch attempts.")
    trainer_devices_fraction: float = Field(1.0, gt=0, le=1, description="local: share of the process's devices "
                                            "the trainer mesh uses (the first ones).")
    sampler_devices_fraction: float = Field(1.0, gt=0, le=1, description="local: share the samplers use (the last "
                                            "ones, split between sampler.replicas); both 1.0 = one shared mesh.")
    verify_prompts: int = Field(0, ge=0, le=1024, description="After the final version, the trainer and every "
                                "sampler record a SHA-256 of their parameters and greedy completions of this many "
                                "held-out prompts (in summary.json / sampler-N.json) to check weights arrived "
                                "exactly; 0 = off.")

    @model_validator(mode="after")
    def _backoff(self) -> "WeightsSection":
        if self.retry_max_s < self.retry_initial_s:
            raise ValueError(f"weights.retry_max_s={self.retry_max_s} < weights.retry_initial_s="
                             f"{self.retry_initial_s}; raise retry_max_s")
        return self


class DistributedSection(Strict):
    initialize: Literal["auto", "always", "never"] = Field(
        "auto", description="jax.distributed.initialize at start-up: 'auto' when the environment describes a "
        "multi-process job (JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID, multi-host TPU, SLURM), "
        "'always', or 'never'.")
