"""A sampler's set-up and teardown: what it starts, and the guarantee that everything it started is stopped.

`open_sampler` builds the task, tokenizer, policy model and engine, serves /metrics, opens the channels to the
trainer and the ingest, waits for the trainer, and starts the weight sync and the rollout sender. It yields them as
`Parts`; on the way out (a finished run, an exception, a signal) it stops, in reverse order, each thing it started:
the sender thread (bounded wait), the ingest channel, background weight fetching, the trainer channel, the metrics
server and the engine (when it has a `close`). Set-up that fails half-way stops what it had started too.

Draining the backlog is not teardown: the loop drains after its last batch, and only then (a sampler stopping on an
error does not wait for acknowledgements).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
from typing import Any, Iterator

import grpc
import jax
from grpc_health.v1 import health_pb2_grpc

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.config.serving import serves_endpoint
from grpo_stream.common.engine.registry import build_engine
from grpo_stream.common.registry.engines import engine_spec
from grpo_stream.common.model.sharding import make_mesh
from grpo_stream.common.rpc.grpc_util import ClientSecurity, open_channel
from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.runtime.prometheus import ServiceMetrics
from grpo_stream.common.tasks.rewards import RewardSet
from grpo_stream.common.weights.registry import weight_source
from grpo_stream.common.weights.transport import SourceContext
from grpo_stream.protos import rollout_pb2_grpc
from grpo_stream.sampler_service.admission_client import AdmissionClient
from grpo_stream.sampler_service.connect import Resume, resume_position, wait_for_trainer
from grpo_stream.sampler_service.rollout_client import RolloutClient
from grpo_stream.sampler_service.weight_sync import WeightSync

log = logging.getLogger(__name__)


class SamplerMetrics:
    """The sampler's Prometheus series, served on sampler.metrics_port + index (0: a free port; null: not served)."""

    def __init__(self, sampler_id: str):
        self._prom = prom = ServiceMetrics(sampler_id)
        self.version = prom.gauge("sampler_weight_version", "weight version this sampler generates with")
        # not sampler_weight_lag: the trainer exports that name per sampler (latest published minus installed)
        self.lag = prom.gauge("sampler_weight_lag_seen", "newest version this sampler has seen minus the installed one")
        self.failures = prom.gauge("sampler_weight_fetch_failures", "failed fetches since the last install")
        self.groups = prom.counter("sampler_groups", "rollout groups generated")
        self.tokens = prom.counter("sampler_tokens", "completion tokens the model sampled (not observations)")
        self.backlog = prom.gauge("sampler_backlog", "groups generated but not yet acknowledged by the ingest")

    def start(self, cfg: RunConfig, index: int) -> None:
        port = cfg.sampler.metrics_port
        self._prom.start(cfg.sampler.metrics_host, None if port is None else (port + index if port else 0),
                         "sampler.metrics_port" if not index else f"sampler.metrics_port + {index} (sampler {index})")

    def stop(self) -> None:
        self._prom.stop()


@dataclasses.dataclass
class Parts:
    """What a running sampler holds, built and stopped by `open_sampler`."""

    task: Any
    tokenizer: Any
    model: Any
    engine: Any
    rewards: RewardSet
    metrics: SamplerMetrics
    health: health_pb2_grpc.HealthStub  # the trainer's health check
    ingest_stub: rollout_pb2_grpc.RolloutIngestStub
    sync: WeightSync
    client: RolloutClient
    admission: AdmissionClient
    resume: Resume  # where this sampler's data stream resumes (connect.py)


def fit_hint(cfg: RunConfig) -> str:
    """What to do when the trainer's weights do not fit this sampler's model: which settings must be the trainer's."""
    if cfg.model.kind == "hf":
        return f"start the sampler with the trainer's model.path (this sampler has model.path={cfg.model.path})"
    tiny = ", ".join(f"{k}={v}" for k, v in cfg.model.tiny.model_dump().items())
    return f"start the sampler with the trainer's model settings (this sampler has model.kind=tiny, model.tiny {tiny})"


def sampler_mesh(cfg: RunConfig, devices: list | None) -> jax.sharding.Mesh:
    """The mesh the weights are placed on: `devices` (default the process's local ones) for an engine on a JAX
    mesh; one host CPU device for an engine that places the weights itself (vLLM takes them from there)."""
    if engine_spec(cfg.sampler.engine).jax_mesh:
        return make_mesh(1, cfg.sampler.mesh.tp, devices or jax.local_devices(), "sampler.mesh.tp")
    return make_mesh(1, 1, jax.devices("cpu")[:1], "sampler.mesh.tp")


def weight_fetcher(cfg: RunConfig, sampler_id: str, channel: grpc.Channel, security: ClientSecurity, hub):
    """This sampler's side of weights.transport."""
    host = cfg.trainer_address().rsplit(":", 1)[0].strip("[]")
    return weight_source(cfg.weights.transport, SourceContext(
        cfg.weights, sampler_id, cfg.sampler.rpc_timeout_s, channel=channel, trainer_host=host, security=security,
        hub=hub))


def _close_engine(engine) -> None:
    close = getattr(engine, "close", None)
    if callable(close):
        close()


@contextlib.contextmanager
def open_sampler(cfg: RunConfig, index: int, sampler_id: str, stop_event, devices=None, hub=None
                 ) -> Iterator[Parts]:
    """Everything sampler `index` runs with, stopped again on the way out (see the module docstring)."""
    with contextlib.ExitStack() as stack:
        task, tokenizer = build_task_and_tokenizer(cfg)
        model = build_policy(cfg, tokenizer.vocab_size, seed=None, dtype=cfg.sampler_dtype())
        engine = build_engine(cfg, model, tokenizer, index)
        stack.callback(_close_engine, engine)
        metrics = SamplerMetrics(sampler_id)
        stack.callback(metrics.stop)
        metrics.start(cfg, index)
        security = ClientSecurity.from_config(cfg)
        channel = open_channel(cfg.trainer_address(), security)
        stack.callback(channel.close)
        health = health_pb2_grpc.HealthStub(channel)
        wait_for_trainer(cfg, health, stop_event)
        mesh = sampler_mesh(cfg, devices)
        # this process's id for the trainer: a restart's reports count anew, and a second process under this
        # sampler id is told apart from a restart (the replaced one is refused admission)
        process = secrets.token_hex(8)
        log.info("%s mesh %s on %s", sampler_id, dict(mesh.shape), [d.id for d in mesh.devices.flat])
        sync = WeightSync(weight_fetcher(cfg, sampler_id, channel, security, hub), model, mesh, sampler_id,
                          cfg.weights.retry_initial_s, cfg.weights.retry_max_s, cfg.trainer.max_staleness, channel,
                          background=cfg.weights.background_fetch, fit_hint=fit_hint(cfg),
                          overdue_after_s=2 * cfg.sampler.rpc_timeout_s + 10, process=process)
        stack.callback(sync.close)
        # rollouts go to the ingest, which is the trainer's server unless it runs on its own (ingest.standalone)
        ingest_channel = channel
        if cfg.ingest_address() != cfg.trainer_address():
            ingest_channel = open_channel(cfg.ingest_address(), security)
            stack.callback(ingest_channel.close)
        ingest_stub = rollout_pb2_grpc.RolloutIngestStub(ingest_channel)
        resume = resume_position(cfg, sampler_id, ingest_stub, stop_event)
        client = RolloutClient(ingest_channel, cfg.sampler.backlog_max_groups, cfg.sampler.max_groups_per_message)
        stack.callback(client.close)
        client.start()
        log.info("%s connected to %s, rollouts to %s (tokenizer %s), data position %d%s", sampler_id,
                 cfg.trainer_address(), cfg.ingest_address(), tokenizer.fingerprint(), resume.start,
                 f" ({len(resume.unanswered)} unanswered below it first)" if resume.unanswered else "")
        admission = AdmissionClient(ingest_stub, sampler_id, cfg.sampler.admission, stop_event, process)
        # after the loop and its drain, before the sender closes: the grants it holds go back to the other samplers
        stack.callback(admission.release)
        yield Parts(task, tokenizer, model, engine, RewardSet(cfg.task.rewards), metrics, health, ingest_stub, sync,
                    client, admission, resume)


@contextlib.contextmanager
def served_over_http(cfg: RunConfig, index: int, sampler_id: str, parts: Parts, current, run_dir) -> Iterator:
    """The sampler's OpenAI-compatible endpoint while the block runs (sampler.openai.port; None when off; a
    task.name=verifiers run always has its routes, which its rollouts call in memory; without a port nothing
    listens). FastAPI and uvicorn are imported only for a sampler that serves it."""
    if not serves_endpoint(cfg):
        yield None
        return
    from grpo_stream.sampler_service.openai_server import openai_endpoint  # noqa: PLC0415 - only when served

    with openai_endpoint(cfg, index, sampler_id, parts.engine, parts.tokenizer, current, run_dir) as endpoint:
        yield endpoint
