"""Run configuration: the strict pydantic RunConfig and its deployment sections (what is learned and how:
learning.py; the vLLM engine's settings: vllm_settings.py; reading files and overrides: loading.py).

One file configures a whole run; every process (trainer, samplers, `up`)
reads the same file plus the same `key.sub=value` overrides, so a
multi-host deployment is the same commands on other machines.

Unknown keys are rejected, every field is documented (the docs become the
field list in `grpo-stream <cmd> --print-config`), and limits are declared
with `Field`. Errors are raised as `ConfigError` with one line per problem
that names the dotted field and says how to fix it.
"""

from __future__ import annotations

import operator
from typing import Annotated, Literal

from pydantic import Field, model_validator

from grpo_stream.common.config.access import AuthSection, PromptsSection, RedisSection, RpcSection, TlsSection
from grpo_stream.common.config.base import ConfigError, FilePath, Strict
from grpo_stream.common.config.environment import EnvironmentSection
from grpo_stream.common.config.learning import (AlgoSection, DistillSection, EvalSection, GenerationSection,
                                               ModelSection, OptimizerSection, WarmStartSection)
from grpo_stream.common.config.task import TaskSection
from grpo_stream.common.config.hardware import HardwareSection
from grpo_stream.common.config.health import HealthSection
from grpo_stream.common.config.ports import port_problem
from grpo_stream.common.config.process import LoggingSection, RuntimeSection, UpSection
from grpo_stream.common.config.sampler import SamplerSection
from grpo_stream.common.config.tracking import TrackingSection
from grpo_stream.common.config.verifiers_settings import sampling_problem
from grpo_stream.common.config.vllm_settings import VllmSection
from grpo_stream.common.config.weights import DistributedSection, WeightsSection
from grpo_stream.common.registry.engines import engine_spec
from grpo_stream.common.registry.environments import environment_spec
from grpo_stream.common.registry.tasks import TASKS, task_spec
from grpo_stream.common.registry.transports import TRANSPORTS, transport_spec

# multi-turn rows in flight per engine slot by default: an episode waits for its environment (a tool, a user) for
# part of its life; the stream starts groups only while fewer turns than slots want the engine, so this is a bound on
# the host's memory and on staleness more than a target (BENCHMARKS.md, "rollouts": with it, a 100 ms tool slower
# than a turn cost 12% of the useful tokens/s and the engine idled 2% of the run)
MULTI_TURN_ROWS = 4

__all__ = ["ConfigError", "DistributedSection", "RunConfig", "Strict", "VllmSection", "WeightsSection"]


class RunSection(Strict):
    name: str = Field("grpo", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$",
                      description="Run name; namespaces the Redis keys so runs can share a server.")
    seed: int = Field(0, ge=0, description="Seed for model init, data order and sampling.")
    deterministic: bool = Field(False, description="Ask XLA for deterministic kernels on GPU (slower scatter and "
                                "reductions; CPU and TPU are deterministic already), so a resumed trainer fed the "
                                "same groups reproduces an uninterrupted one bit for bit.")


class TrainerMeshSection(Strict):
    """The trainer's device mesh: parameters and optimizer state sharded FSDP x tensor parallel."""

    fsdp: int = Field(1, ge=1, le=65536, description="Devices parameters (and batch rows) are sharded over, FSDP.")
    tp: int = Field(1, ge=1, le=1024, description="Tensor-parallel devices (heads, MLP width, vocabulary).")


class TrainerSection(Strict):
    mesh: TrainerMeshSection = Field(default_factory=TrainerMeshSection, description="The trainer's mesh.")
    host: str = Field("127.0.0.1", description="Address the trainer's gRPC server (ingest + weights) binds.")
    port: int = Field(50151, ge=0, le=65535, description="Port of the trainer's gRPC server; `up` picks a free one.")
    steps: int = Field(60, ge=1, le=10_000_000, description="RL optimizer steps to run.")
    groups_per_step: int = Field(16, ge=1, le=100_000, description="Rollout groups in one optimizer step.")
    learning_rate: float = Field(1e-3, gt=0, le=1, description="Peak learning rate of the RL phase.")
    max_grad_norm: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection, description="Adam or AdamW, and the "
                                        "learning-rate schedule.")
    micro_batch_size: int | None = Field(None, ge=1, le=1_000_000, description="Gradient accumulation: sequences "
                                         "per forward/backward pass (with trainer.packing and no "
                                         "tokens_per_micro_batch: packed rows per pass), summed into each "
                                         "minibatch's one update (same update, less activation memory); without "
                                         "packing it must divide the minibatch. Null: the whole minibatch at once "
                                         "(with packing, rows for a quarter of its sequences per pass).")
    packing: bool = Field(True, description="Pack the update's sequences several to a row of "
                          "generation.max_prompt_tokens + max_new_tokens tokens (attention within each sequence, "
                          "positions restarting), so its forward and backward passes compute real tokens rather than "
                          "padding; the loss, gradients and statistics are the padded layout's (docs/packing.md). "
                          "false: each sequence alone in its row, through the same update.")
    tokens_per_micro_batch: int | None = Field(None, ge=2, le=1_000_000_000, description="With packing: tokens of "
                                               "one forward/backward pass over the whole mesh, in rows of "
                                               "max_prompt_tokens + max_new_tokens (this // that rows, at most the "
                                               "minibatch's sequences, rounded up to a multiple of "
                                               "trainer.mesh.fsdp); a minibatch's passes are summed "
                                               "into its one update. The update's activation memory follows it. "
                                               "Null: trainer.micro_batch_size rows, or a quarter of a minibatch's "
                                               "sequences.")
    remat: Literal["none", "attention", "full", "save_dots"] = Field(
        "none", description="Rematerialisation in the update step: recompute each layer's attention block "
        "('attention') or whole decoder layer ('full') in the backward pass instead of keeping its activations, or "
        "the whole layer except the outputs of its weight matrix products ('save_dots': most of full's saving, "
        "recomputing only elementwise work) (Tunix's switch; llama3, qwen2, qwen3).")
    max_staleness: int = Field(4, ge=0, le=10_000, description="Groups whose policy_version is more than this many "
                               "trainer steps behind are dropped (counted). 0 = fully on-policy.")
    publish_every: int = Field(1, ge=1, le=100_000, description="Publish weights every this many steps.")
    final_wait_s: float = Field(60.0, ge=0, le=3600, description="After the last step, how long to wait for every "
                                "sampler to install the final weights before shutting down.")
    cpu_affinity: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="CPU cores the trainer process runs on (Linux sched_setaffinity); null = "
        "all cores.")
    metrics_port: int | None = Field(0, ge=0, le=65535, description="Prometheus /metrics port of the trainer; "
                                     "0 = a free port, null = off.")
    metrics_host: str | None = Field(None, description="Address the trainer's /metrics binds; null = trainer.host "
                                     "(a trainer serving gRPC on 0.0.0.0 serves /metrics there too: set 127.0.0.1 "
                                     "to keep it on the host).")
    eval_before: bool = Field(True, description="Evaluate on the held-out split when RL starts.")
    eval_after: bool = Field(True, description="Evaluate on the held-out split when RL ends.")
    processes: int = Field(1, ge=1, le=4096, description="JAX processes (one per host; trainer.mesh spans all their "
                           "devices) joined by distributed.initialize; process 0 leads (docs/multi-host.md).")
    record_batches: bool = Field(False, description="Write each step's batch to RUN_DIR/batches/step-N.npz.")
    prefetch_plans: bool = Field(True, description="Make each RL step's plan (read its groups from the buffer, build "
                                 "and pack its batch) on a worker thread while the previous step's update computes, "
                                 "so the main thread goes from one update to the next; staleness is still judged "
                                 "against the step that trains the group. false: the main thread makes each plan "
                                 "between updates (docs/rollouts-and-weights.md, \"The trainer's step\").")
    lease_ttl_s: float = Field(15.0, ge=1, le=3600, description="The trainer's lease on its run in Redis (one trainer "
                               "per run; common/rollouts/trainer_lease.py): renewed every third of this while the "
                               "trainer runs. A new trainer waits up to this long after one that stopped without "
                               "releasing it on another machine (on the same machine a dead holder is seen at once).")
    health: HealthSection = Field(default_factory=HealthSection, description="When to warn that training is too "
                                  "off-policy (docs/objective.md, \"Off-policy health\").")

    @model_validator(mode="after")
    def _staleness(self) -> "TrainerSection":
        if self.max_staleness < self.publish_every - 1:
            raise ValueError(
                f"trainer.max_staleness={self.max_staleness} < trainer.publish_every-1={self.publish_every - 1}: "
                "groups from the newest published weights would be dropped; raise max_staleness")
        if problem := self.optimizer.schedule_problem(self.steps):
            raise ValueError(problem)
        return self


class BufferSection(Strict):
    max_groups: int = Field(256, ge=1, le=10_000_000, description="Groups waiting to be trained above which the "
                            "ingest tells producers to wait (RESOURCE_EXHAUSTED + retry). Nothing is dropped. Groups "
                            "trained but held until a checkpoint (up to about 2 x checkpoint.every x "
                            "trainer.groups_per_step) stay in Redis too but do not count.")
    retry_after_ms: int = Field(200, ge=1, le=60_000, description="Back-off the ingest suggests when full.")
    compact_audit: bool = Field(True, description="After each acknowledged checkpoint, fold the audit trail of the "
                                "groups settled up to it into counts (P:R:audit:compacted), so a run's Redis memory "
                                "stays bounded; `audit` still proves exactly-once over the whole run. false keeps "
                                "every group's record (`audit --group` then finds any group of the run).")


class CheckpointSection(Strict):
    """Trainer checkpoints (Orbax): what a restarted trainer resumes from; see docs/operations.md, "Exactly once: what
    survives a crash"."""

    dir: FilePath = Field(None, description="Directory (local, NFS or gs://) of the trainer's checkpoints; null = "
                            "RUN_DIR/checkpoints.")
    every: int = Field(25, ge=1, le=1_000_000, description="Checkpoint every this many RL steps (and at the last "
                       "step and on SIGTERM). Groups are acknowledged in the buffer only once a checkpoint holding "
                       "their update is saved, so a crash replays at most this many steps.")
    keep: int = Field(3, ge=2, le=1000, description="Checkpoints kept (older ones are deleted), at least 2: a "
                      "corrupt newest one falls back to the one before, which the acknowledged groups need.")
    resume: bool = Field(True, description="Start from the newest valid checkpoint in `dir` when there is one "
                         "(false: refuse to start over an existing one, so a new run cannot mix with an old).")
    verify: bool = Field(True, description="Write the SHA-256s of each checkpoint's files beside it once it is "
                         "saved (hashed on a background thread while training goes on) and check them on restore "
                         "before reading the arrays; a checkpoint that differs is set aside as corrupt-<step>-<time>, "
                         "one whose digest was never written (the trainer died right after the save) as "
                         "unverified-<step>-<time>, and the one before is used (its groups are still in the buffer, "
                         "so nothing is lost). Groups are acknowledged only once their checkpoint's digest is written.")


class IngestSection(Strict):
    """Where samplers send rollout groups."""

    standalone: bool = Field(False, description="Run the ingest as its own process (`grpo-stream ingest`; `up` "
                             "starts one) so samplers keep delivering while the trainer restarts; false = the "
                             "trainer's gRPC server also serves it.")
    host: str = Field("127.0.0.1", description="standalone: address the ingest binds.")
    port: int = Field(50152, ge=0, le=65535, description="standalone: port of the ingest; `up` picks a free one.")
    address: str | None = Field(None, description="host:port samplers send rollouts to. Null: 127.0.0.1:<ingest.port> "
                                "when standalone, else the trainer's address.")


class RunConfig(Strict):
    """The whole run. Sections mirror the processes and links."""

    run: RunSection = Field(default_factory=RunSection, description="Run identity and seed.")
    redis: RedisSection = Field(default_factory=RedisSection, description="The rollout buffer's Redis.")
    model: ModelSection = Field(default_factory=ModelSection, description="Policy model and tokenizer.")
    task: TaskSection = Field(default_factory=TaskSection, description="Prompts, answers and rewards.")
    generation: GenerationSection = Field(default_factory=GenerationSection, description="Sampling settings "
                                          "shared by samplers and trainer.")
    sampler: SamplerSection = Field(default_factory=SamplerSection, description="Sampler processes.")
    trainer: TrainerSection = Field(default_factory=TrainerSection, description="Trainer process.")
    buffer: BufferSection = Field(default_factory=BufferSection, description="Rollout buffer flow control.")
    ingest: IngestSection = Field(default_factory=IngestSection, description="The rollout ingest service.")
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection, description="Trainer checkpoints.")
    algo: AlgoSection = Field(default_factory=AlgoSection, description="Policy-gradient objective.")
    distill: DistillSection = Field(default_factory=DistillSection, description="On-policy distillation from a "
                                    "teacher model (null teacher: off).")
    weights: WeightsSection = Field(default_factory=WeightsSection, description="Weight publication.")
    distributed: DistributedSection = Field(default_factory=DistributedSection, description="Multi-host JAX.")
    warmstart: WarmStartSection = Field(default_factory=WarmStartSection, description="Supervised warm start.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Held-out evaluation.")
    logging: LoggingSection = Field(default_factory=LoggingSection, description="Logging.")
    tracking: TrackingSection = Field(default_factory=TrackingSection, description="Trackers beyond the files: W&B.")
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection, description="Multi-turn episodes "
                                            "with tools (null name: single-turn tasks).")
    up: UpSection = Field(default_factory=UpSection, description="How `up` restarts the processes it starts.")
    # default validated like a given section, so a bad $GRPO_STREAM_COMPILATION_CACHE_DIR names runtime.<field>
    runtime: RuntimeSection = Field(default_factory=dict, validate_default=True, description="Process runtime: "
                                    "the persistent compilation cache.")
    auth: AuthSection = Field(default_factory=AuthSection, description="Bearer tokens and roles on every RPC.")
    tls: TlsSection = Field(default_factory=TlsSection, description="TLS (and mutual TLS) for every server.")
    prompts: PromptsSection = Field(default_factory=PromptsSection, description="Prompt injection limits.")
    rpc: RpcSection = Field(default_factory=RpcSection, description="Calls each gRPC server serves at once.")
    hardware: HardwareSection = Field(default_factory=HardwareSection, description="The accelerators the run is "
                                      "sized for, which `grpo-stream plan` checks the memory of.")

    @model_validator(mode="after")
    def _task_and_model(self) -> "RunConfig":
        task = task_spec(self.task.name)
        if task.dataset and not self.task.dataset.source:
            raise ValueError(f"task.name={self.task.name} needs task.dataset.source (e.g. ../shared/data/gsm8k or "
                             "openai/gsm8k)")
        if not task.warmstart and self.warmstart.steps:
            raise ValueError(f"warmstart.steps: the supervised warm start exists for the tasks "
                             f"{[n for n, t in TASKS.items() if t.warmstart]} only; set it to 0")
        if self.model.kind == "hf" and self.warmstart.steps:
            raise ValueError(f"warmstart.steps: the {self.task.name} warm start trains the tiny model only; set it "
                             "to 0")
        if self.eval.every_steps and self.eval.every_steps % self.trainer.publish_every:
            every, publish = self.eval.every_steps, self.trainer.publish_every
            raise ValueError(f"eval.every_steps={every} is not a multiple of trainer.publish_every={publish}: it "
                             f"evaluates published versions; make it a multiple (e.g. "
                             f"{publish * max(1, every // publish)})")
        if self.eval.every_steps and self.trainer.processes > 1:
            raise ValueError(f"eval.every_steps: the background evaluation runs in one trainer process, and "
                             f"trainer.processes={self.trainer.processes} evaluate on a mesh that spans them all; set "
                             "eval.every_steps=0 (eval_before/eval_after still run)")
        if self.eval.samples and max(self.eval.ks) > self.eval.samples:
            raise ValueError(f"eval.ks={self.eval.ks}: each k must be at most eval.samples={self.eval.samples}")
        if self.distill.enabled and self.distill.reward_weight == 0 and self.algo.dynamic_sampling:
            raise ValueError("algo.dynamic_sampling drops groups whose rewards are all equal, but with "
                             "distill.reward_weight=0 every group carries the teacher's signal; set "
                             "algo.dynamic_sampling=false or give distill.reward_weight a weight")
        if self.distill.enabled and self.distill.reward_weight == 0 and self.algo.overlong == "penalty":
            raise ValueError("algo.overlong=penalty lowers the rewards of over-long completions, but with "
                             "distill.reward_weight=0 rewards do not reach the advantage, so the penalty does nothing; "
                             "give distill.reward_weight a weight, or use algo.overlong=filter (or none)")
        if task.own_rollouts and self.environment.name is not None:
            raise ValueError(f"environment.name: task.name={self.task.name} runs its own episodes; leave it unset")
        gen = self.generation
        if task.own_rollouts and (problem := sampling_problem(self.task.verifiers.sampling_args, gen.temperature,
                                                              gen.max_new_tokens)):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _environment(self) -> "RunConfig":
        env = self.environment
        if env.name is None:
            return self
        spec = environment_spec(env.name)
        if self.task.name not in spec.tasks:
            raise ValueError(f"environment.name={env.name} takes the problems of task.name in {list(spec.tasks)}; "
                             f"set task.name to one of them")
        if env.turn_max_new_tokens is not None and env.turn_max_new_tokens > self.generation.max_new_tokens:
            raise ValueError(f"environment.turn_max_new_tokens={env.turn_max_new_tokens} exceeds "
                             f"generation.max_new_tokens={self.generation.max_new_tokens}, the whole episode's budget")
        return self

    @model_validator(mode="after")
    def _ingest(self) -> "RunConfig":
        transport, engine = transport_spec(self.weights.transport), engine_spec(self.sampler.engine)
        if self.ingest.standalone and transport.in_process:
            raise ValueError(f"ingest.standalone: weights.transport={self.weights.transport} runs trainer and samplers "
                             "in one process, which serves the ingest itself; set ingest.standalone=false")
        if transport.in_process and not engine.in_trainer_process:
            raise ValueError(f"sampler.engine={self.sampler.engine} runs each sampler as its own process; "
                             f"weights.transport={self.weights.transport} shares the trainer's process: choose one of "
                             f"{[n for n, t in TRANSPORTS.items() if not t.in_process]}")
        if self.sampler.weight_updates == "in_flight" and not engine.in_flight_updates:
            raise ValueError(f"sampler.weight_updates=in_flight: sampler.engine={self.sampler.engine} switches weights "
                             "only between serves; use engine=jax or weight_updates=drain")
        n, devices = self.trainer.processes, self.trainer.mesh.fsdp * self.trainer.mesh.tp
        if n > 1 and devices % n:
            raise ValueError(f"trainer.processes={n}: the trainer mesh (trainer.mesh fsdp x tp = {devices} devices) "
                             f"must spread evenly over the processes; make fsdp x tp a multiple of {n} (e.g. "
                             f"trainer.mesh.fsdp={n * max(1, devices // n)})")
        if n > 1 and not transport.trainer_serves:
            raise ValueError(f"trainer.processes={n}: each trainer process serves its own slices of the weights, "
                             f"which weights.transport={self.weights.transport} cannot; set weights.transport=grpc")
        if n > 1 and self.model.lora is not None:
            raise ValueError(f"trainer.processes={n} with model.lora: process 0 alone saves and publishes the frozen "
                             "LoRA base, which the other processes could neither restore nor serve; train LoRA with "
                             "trainer.processes=1 (adapters and their optimizer state fit one host) or drop model.lora")
        return self

    @model_validator(mode="after")
    def _minibatches(self) -> "RunConfig":
        rows = self.trainer.groups_per_step * self.generation.num_generations
        if rows % self.algo.minibatches:
            raise ValueError(f"algo.minibatches={self.algo.minibatches} must divide the {rows} sequences of a step "
                             "(trainer.groups_per_step x generation.num_generations)")
        micro = self.trainer.micro_batch_size
        length = self.generation.max_prompt_tokens + self.generation.max_new_tokens
        budget = self.trainer.tokens_per_micro_batch
        if budget is not None and not self.trainer.packing:
            raise ValueError(f"trainer.tokens_per_micro_batch={budget} sizes packed passes; with trainer.packing=false "
                             "use trainer.micro_batch_size, or drop trainer.packing=false")
        if budget is not None and budget < length:
            raise ValueError(f"trainer.tokens_per_micro_batch={budget} is below one row of generation."
                             f"max_prompt_tokens + generation.max_new_tokens = {length} tokens; raise it to at least "
                             f"{length}")
        if micro is not None and not self.trainer.packing and (rows // self.algo.minibatches) % micro:
            raise ValueError(f"trainer.micro_batch_size={micro} must divide the {rows // self.algo.minibatches} "
                             "sequences of a minibatch (trainer.groups_per_step x generation.num_generations / "
                             "algo.minibatches)")
        if self.algo.overlong_buffer_tokens > self.generation.max_new_tokens:
            raise ValueError(f"algo.overlong_buffer_tokens={self.algo.overlong_buffer_tokens} exceeds "
                             f"generation.max_new_tokens={self.generation.max_new_tokens}")
        cap = self.sampler.max_groups_per_version
        need = self.trainer.groups_per_step * self.trainer.publish_every
        if cap is not None and cap * self.sampler.replicas < need:
            raise ValueError(f"sampler.max_groups_per_version={cap} x sampler.replicas={self.sampler.replicas} < "
                             f"trainer.groups_per_step x trainer.publish_every = {need}: the samplers would wait "
                             "for weights the trainer cannot make; raise max_groups_per_version")
        return self

    @model_validator(mode="after")
    def _buffer_holds_a_step(self) -> "RunConfig":
        # groups the trainer has read for a step but not trained still wait in the buffer (count against max_groups)
        if self.buffer.max_groups < self.trainer.groups_per_step:
            raise ValueError(f"buffer.max_groups={self.buffer.max_groups} < trainer.groups_per_step="
                             f"{self.trainer.groups_per_step}: the ingest would refuse groups before a step could "
                             "fill, and the trainer would wait for ever; raise buffer.max_groups to at least "
                             f"{self.trainer.groups_per_step}")
        return self

    @model_validator(mode="after")
    def _ports(self) -> "RunConfig":
        if problem := port_problem(self):
            raise ValueError(problem)
        return self

    def engine_slots(self) -> tuple[str, int]:
        """(the field, its value) of the most sequences a sampler's engine decodes at once (its KV cache holds them):
        generation.decode_slots for the JAX engine, sampler.vllm.max_num_seqs for vLLM (the engine registry's)."""
        field = engine_spec(self.sampler.engine).slots
        return field, operator.attrgetter(field)(self)

    def rows_in_flight(self) -> int:
        """The most episodes each sampler keeps in flight: sampler.rows_in_flight, or what fills its engine (for
        multi-turn episodes, which leave their slots while an environment answers, MULTI_TURN_ROWS times that: the
        stream then starts groups while fewer turns than slots want the engine)."""
        if self.sampler.rows_in_flight is not None:
            return self.sampler.rows_in_flight
        multi_turn = self.environment.name is not None or task_spec(self.task.name).own_rollouts
        return self.engine_slots()[1] * (MULTI_TURN_ROWS if multi_turn else 1)

    def rows_held(self) -> int:
        """The most rows a sampler holds: whole groups of generation.num_generations within rows_in_flight()."""
        return self.rows_in_flight() // self.generation.num_generations * self.generation.num_generations

    def largest_group(self) -> int:
        """The most rows one group may have on a sampler: a group's rows start together, within
        sampler.rows_in_flight and within the engine's slots (the stream starts no more rows than slots are free)."""
        return min(self.rows_in_flight(), self.engine_slots()[1])

    @model_validator(mode="after")
    def _rows_in_flight(self) -> "RunConfig":
        (where, slots), rows, group = self.engine_slots(), self.rows_in_flight(), self.generation.num_generations
        if rows < group:
            raise ValueError(f"sampler.rows_in_flight={rows} holds no group of generation.num_generations={group}; "
                             f"raise it to at least {group}")
        if slots < group:
            raise ValueError(f"generation.num_generations={group}: a group's rows start together, and the engine "
                             f"decodes at most {where}={slots} sequences at once, so no group could ever start; "
                             f"raise {where} to at least {group}")
        multi_turn = self.environment.name is not None or task_spec(self.task.name).own_rollouts
        if rows > slots and not multi_turn:
            raise ValueError(f"sampler.rows_in_flight={rows}: the engine decodes at most {where}={slots} sequences "
                             f"at once (its KV cache holds that many); single-turn rows beyond it would only wait, "
                             f"older: lower it to {slots} or raise {where}")
        return self

    def sampler_dtype(self) -> str:
        """The samplers' parameter dtype: sampler.dtype, or model.dtype when that says 'model'."""
        return self.model.dtype if self.sampler.dtype == "model" else self.sampler.dtype

    def trainer_address(self) -> str:
        return self.sampler.trainer_address or f"127.0.0.1:{self.trainer.port}"

    def ingest_address(self) -> str:
        if self.ingest.address:
            return self.ingest.address
        return f"127.0.0.1:{self.ingest.port}" if self.ingest.standalone else self.trainer_address()
