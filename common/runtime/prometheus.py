"""Prometheus `/metrics` for a service: a private registry per process, served on its own port."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

log = logging.getLogger(__name__)
PREFIX = "grpo_stream_"
OTHER = "(other)"  # the one series past a labelled gauge's bound


def bounded_series(values: dict[str, float], max_series: int) -> dict[str, float]:
    """`values` with at most `max_series` keys of their own, in their order, and the rest folded into OTHER (their
    largest value): label values that come from callers (sampler ids: a token may speak for any `<name>-<k>`) must
    not grow a scrape, a TSDB or a TensorBoard file without bound."""
    keys = list(values)
    kept = {key: values[key] for key in keys[:max_series]}
    rest = [values[key] for key in keys[max_series:]]
    return {**kept, OTHER: max(rest)} if rest else kept


class BoundedGauge:
    """A gauge with one label whose values come from callers: each `replace` shows the current values only (a
    value no longer given, e.g. a sampler forgotten, loses its series) and at most `max_series` of them, the rest
    as one OTHER series (bounded_series)."""

    def __init__(self, gauge: Gauge, max_series: int):
        self.gauge, self.max_series = gauge, max_series
        self._shown: set[str] = set()

    def replace(self, values: dict[str, float]) -> None:
        shown = bounded_series(values, self.max_series)
        for gone in self._shown - set(shown):
            self.gauge.remove(gone)
        for label, value in shown.items():
            self.gauge.labels(label).set(value)
        self._shown = set(shown)


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
