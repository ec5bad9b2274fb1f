"""Prometheus `/metrics` for a service: a private registry per process, served on its own port."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

log = logging.getLogger(__name__)
PREFIX = "grpo_stream_"


class ServiceMetrics:
    """Gauges and counters of one process, exposed at http://host:port/metrics once `start`ed."""

    def __init__(self, service: str):
        self.service = service
        self.registry = CollectorRegistry()
        self._server = None
        self.port: int | None = None

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(PREFIX + name, doc, labels, registry=self.registry)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def start(self, host: str, port: int | None) -> int | None:
        """Serve on `port` (0 = a free one); None = do not serve. Returns the bound port."""
        if port is None:
            return None
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        log.info("%s metrics at http://%s:%d/metrics", self.service, host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
