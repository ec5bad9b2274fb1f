"""`grpo-stream ingest`: the rollout ingest as its own process (ingest.standalone).

Samplers keep delivering groups into Redis while the trainer restarts; any number of ingest replicas can
share one buffer (appends are atomic Lua scripts, de-duplicated by group id). Its health check reports
SERVING only while Redis answers, so a load balancer or a sampler's retries steer around an outage; while
Redis is down every group is answered UNAVAILABLE and stays with its sampler. SIGTERM stops accepting,
lets in-flight calls finish (their groups are either written or answered UNAVAILABLE) and exits 0.
"""

from __future__ import annotations

import logging
import threading

import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.rpc.grpc_util import ServerSecurity, bind, enable_reflection, new_server
from grpo_stream.trainer_service.ingest.prompt_queue import InjectedShare, PromptQueue
from grpo_stream.common.tasks.rewards import allowed_names
from grpo_stream.trainer_service.ingest.proto_decode import add_service
from grpo_stream.common.rollouts.redis_server import connect_durable
from grpo_stream.common.assembly.parts import build_task_and_tokenizer
from grpo_stream.common.runtime.process import stop_on_signals
from grpo_stream.common.rollouts.wire import group_limits
from grpo_stream.protos import prompts_pb2, rollout_pb2  # noqa: F401 - registers the services' descriptors
from grpo_stream.trainer_service.ingest.admission import AdmissionControl, AdmissionLimits
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer, Injection
from grpo_stream.trainer_service.ingest.prompt_service import PromptServicer

log = logging.getLogger(__name__)
SERVICE, PROMPTS = "grpo_stream.v1.RolloutIngest", "grpo_stream.v1.PromptService"


def ingest_servicers(cfg: RunConfig, buffer: RedisStreamBuffer, task, tokenizer, security: ServerSecurity | None
                     ) -> tuple[IngestServicer, PromptServicer]:
    """The ingest and the PromptService beside it, sharing the run's prompt queue."""
    gen = cfg.generation
    limits = group_limits(gen, tokenizer.vocab_size)
    queue = PromptQueue(buffer.client, cfg.run.name)
    injection = Injection(queue, cfg.run.name, cfg.prompts.claim_lease_s, cfg.prompts.result_retention_s,
                          cfg.prompts.max_kept_results, frozenset(allowed_names(cfg.task.rewards, cfg.task.name)),
                          InjectedShare(cfg.prompts.max_injected_fraction,
                                        max(1, cfg.rows_in_flight() // gen.num_generations), gen.num_generations),
                          max_claims=cfg.prompts.max_claims)
    admission = AdmissionControl(AdmissionLimits(cfg.trainer.groups_per_step, cfg.trainer.max_staleness,
                                                 cfg.trainer.steps, cfg.sampler.admission_lease_s,
                                                 cfg.sampler.admission_max_samplers))
    table = None if security is None else security.table
    ingest = IngestServicer(buffer, limits, cfg.buffer.max_groups, cfg.buffer.retry_after_ms, injection, admission,
                            table, max_text_chars=cfg.prompts.max_text_chars)
    return ingest, PromptServicer(cfg, queue, tokenizer, task, table)


class IngestServer:
    def __init__(self, cfg: RunConfig, client: redis.Redis, task, tokenizer, security: ServerSecurity | None = None):
        self.cfg, self.client, self.security = cfg, client, security
        self.servicer, self.prompts = ingest_servicers(cfg, RedisStreamBuffer(client, cfg.run.name), task, tokenizer,
                                                       security)
        self.health = health.HealthServicer()
        self._server = new_server(security)  # its call limits: cfg.rpc and cfg.prompts.max_followers
        add_service(self._server, self.servicer, SERVICE)
        add_service(self._server, self.prompts, PROMPTS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        enable_reflection(self._server, [SERVICE, PROMPTS])
        self.port = 0

    def start(self) -> int:
        self.port = bind(self._server, self.cfg.ingest.host, self.cfg.ingest.port, self.security, "ingest.port")
        self._server.start()
        return self.port

    def watch_redis(self, stop: threading.Event, every_s: float = 1.0) -> None:
        """Keep the health status in step with Redis until `stop` is set; log each change once."""
        up = None
        while not stop.is_set():
            try:
                self.client.ping()
                now_up = True
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError) as exc:
                now_up, reason = False, exc
            if now_up != up:
                status = health_pb2.HealthCheckResponse.SERVING if now_up else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in ("", SERVICE, PROMPTS):
                    self.health.set(name, status)
                if up is not None or not now_up:
                    log.log(logging.INFO if now_up else logging.ERROR, "Redis %s", "is back: accepting groups"
                            if now_up else f"unavailable ({reason}): answering UNAVAILABLE until it returns")
                up = now_up
            stop.wait(every_s)

    def stop(self, grace_s: float = 5.0) -> None:
        self.health.enter_graceful_shutdown()
        self._server.stop(grace_s).wait()


def run_ingest(cfg: RunConfig) -> dict:
    if cfg.redis.url is None:
        raise ValueError("redis.url is null: the ingest needs the buffer's Redis URL (e.g. redis.url=redis://host:6379/0)")
    security = ServerSecurity.from_config(cfg)  # a missing token table or certificate fails before any wait
    stop = threading.Event()
    stop_on_signals(stop, "in-flight calls")  # before the wait for Redis, which a stop ends
    client = connect_durable(cfg.redis, "ingest", stop)
    task, tokenizer = build_task_and_tokenizer(cfg)  # token limits, and the template of injected questions
    server = IngestServer(cfg, client, task, tokenizer, security)
    port = server.start()
    log.info("ingest for run %s on %s:%d (buffer.max_groups %d)", cfg.run.name, cfg.ingest.host, port,
             cfg.buffer.max_groups)
    try:
        server.watch_redis(stop)
    finally:
        server.stop()
    log.info("ingest stopped: %s", server.servicer.stats)
    return dict(server.servicer.stats)
