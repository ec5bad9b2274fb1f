"""The trainer's gRPC server: ingest (unless it runs on its own), weight publication and grpc.health.v1 on one port
(plus, with a `data_port`, the TCP data plane for weight slices)."""

from __future__ import annotations

from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.grpc_util import SERVER_OPTIONS
from protos import rollout_pb2_grpc, weights_pb2_grpc
from trainer_service.ingest import IngestServicer
from trainer_service.publisher import WeightPublisher
from trainer_service.weight_data_server import WeightDataServer

SERVICES = ("grpo_stream.v1.RolloutIngest", "grpo_stream.v1.WeightService")


class TrainerServer:
    """Owns a grpc.Server; `start()` binds and returns the port, `stop()` drains in-flight calls."""

    def __init__(self, ingest: IngestServicer | None, publisher: WeightPublisher, host: str, port: int, workers: int = 16,
                 data_port: int | None = None):
        self.ingest, self.publisher = ingest, publisher
        self.data = None if data_port is None else WeightDataServer(publisher, host, data_port)
        self.host, self.port = host, port
        self.health = health.HealthServicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=SERVER_OPTIONS)
        if ingest is not None:
            rollout_pb2_grpc.add_RolloutIngestServicer_to_server(ingest, self._server)
        weights_pb2_grpc.add_WeightServiceServicer_to_server(publisher, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    def start(self) -> int:
        bound = self._server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            raise OSError(f"trainer.port={self.port}: cannot bind {self.host}:{self.port} (in use?); pick another "
                          "port or 0 for a free one")
        self.port = bound
        if self.data is not None:
            self.data.start()
        self._server.start()
        for name in ("", *(s for s in SERVICES if self.ingest is not None or "Ingest" not in s)):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return bound

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        if self.data is not None:
            self.data.stop()
        self._server.stop(grace_s).wait()
