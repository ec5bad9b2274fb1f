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
from concurrent import futures

import grpc
import redis
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.buffer import RedisStreamBuffer
from common.config import RunConfig
from common.grpc_util import SERVER_OPTIONS
from common.redis_util import connect
from common.runtime import build_task_and_tokenizer, stop_on_signals
from common.wire import GroupLimits
from protos import rollout_pb2_grpc
from trainer_service.ingest import IngestServicer

log = logging.getLogger(__name__)
SERVICE = "grpo_stream.v1.RolloutIngest"


class IngestServer:
    def __init__(self, cfg: RunConfig, client: redis.Redis, vocab_size: int, workers: int = 16):
        gen = cfg.generation
        self.cfg, self.client = cfg, client
        limits = GroupLimits(gen.num_generations, gen.max_prompt_tokens, gen.max_new_tokens, vocab_size)
        self.servicer = IngestServicer(RedisStreamBuffer(client, cfg.run.name), limits, cfg.buffer.max_groups,
                                       cfg.buffer.retry_after_ms)
        self.health = health.HealthServicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=SERVER_OPTIONS)
        rollout_pb2_grpc.add_RolloutIngestServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = 0

    def start(self) -> int:
        host, port = self.cfg.ingest.host, self.cfg.ingest.port
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"ingest.port={port}: cannot bind {host}:{port} (in use?); pick another port or 0")
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
                for name in ("", SERVICE):
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
    stop = threading.Event()
    stop_on_signals(stop, "in-flight calls")
    client = connect(cfg.redis.url, cfg.redis.connect_timeout_s)
    _, tokenizer = build_task_and_tokenizer(cfg)  # the vocabulary bounds valid token ids
    server = IngestServer(cfg, client, tokenizer.vocab_size)
    port = server.start()
    log.info("ingest for run %s on %s:%d (buffer.max_groups %d)", cfg.run.name, cfg.ingest.host, port,
             cfg.buffer.max_groups)
    try:
        server.watch_redis(stop)
    finally:
        server.stop()
    log.info("ingest stopped: %s", server.servicer.stats)
    return dict(server.servicer.stats)
