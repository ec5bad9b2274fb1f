"""The trainer's gRPC server: ingest and PromptService (unless the ingest runs on its own), weight publication,
grpc.health.v1 and reflection on one port (plus, with a `data_port`, the TCP data plane for weight slices).
Every RPC is authenticated and role-checked when `security` carries a token table (common/rpc/auth.py)."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from grpo_stream.common.rpc.grpc_util import ServerSecurity, bind, enable_reflection, new_server
from grpo_stream.trainer_service.ingest.proto_decode import add_service
from grpo_stream.protos import prompts_pb2, rollout_pb2, weights_pb2  # noqa: F401 - registers the services' descriptors
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.publication.grpc_transport_server.data_plane import WeightDataServer
from grpo_stream.trainer_service.publication.grpc_transport_server.slices import SliceServer
from grpo_stream.trainer_service.publication.weight_service import WeightService

INGEST, WEIGHTS, PROMPTS = "grpo_stream.v1.RolloutIngest", "grpo_stream.v1.WeightService", "grpo_stream.v1.PromptService"


class TrainerServer:
    """Owns a grpc.Server; `start()` binds and returns the port, `stop()` drains in-flight calls."""

    def __init__(self, ingest: IngestServicer | None, publisher: WeightPublisher, host: str, port: int,
                 data_port: int | None = None, security: ServerSecurity | None = None, prompts=None,
                 max_serve_mb_s: float | None = None):
        """`prompts`: a PromptServicer to serve beside the ingest (None: none). How many calls it serves at once,
        by kind: `security.limits` (config rpc; defaults without `security`). `max_serve_mb_s`: each weight fetch's
        cap in bytes per second, over gRPC and the data plane (None: none)."""
        self.ingest, self.publisher, self.security = ingest, publisher, security
        table = None if security is None else security.table
        self.slices = SliceServer(publisher, max_serve_mb_s)
        self.weights = WeightService(publisher, self.slices, table)
        self.data = None if data_port is None else WeightDataServer(
            publisher, host, data_port, table=table, ssl_context=None if security is None else security.ssl_context,
            slices=self.slices)
        self.host, self.port = host, port
        self.health = health.HealthServicer()
        self._server = new_server(security)
        self.services = [WEIGHTS]
        if ingest is not None:
            add_service(self._server, ingest, INGEST)
            self.services.append(INGEST)
        if prompts is not None:
            add_service(self._server, prompts, PROMPTS)
            self.services.append(PROMPTS)
        add_service(self._server, self.weights, WEIGHTS)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        enable_reflection(self._server, self.services)

    def start(self) -> int:
        self.port = bind(self._server, self.host, self.port, self.security, "trainer.port")
        if self.data is not None:
            self.data.start()
        self._server.start()
        for name in ("", *self.services):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    def stop(self, grace_s: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        if self.data is not None:
            self.data.stop()
        self._server.stop(grace_s).wait()
