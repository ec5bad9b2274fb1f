"""Prometheus `/metrics` for a service: a private registry per process, served on its own port.

The page is served by a small threaded WSGI server of this module's, not prometheus_client's start_http_server: that
one gives every connection a thread that waits for the request for ever, so connections that send nothing (a port
scanner, a stuck scraper, anyone who can reach the port) grew the trainer's threads without bound. Here a connection
must send its request within REQUEST_TIMEOUT_S, and at most MAX_CONNECTIONS are served at once (more are closed at
once; a scraper retries at its next interval).
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, make_wsgi_app
from prometheus_client.core import CounterMetricFamily

log = logging.getLogger(__name__)
PREFIX = "grpo_stream_"
OTHER = "(other)"  # the one series past a labelled gauge's bound
REQUEST_TIMEOUT_S = 10.0  # a connection silent this long (per read or write) is closed
MAX_CONNECTIONS = 16  # served at once; Prometheus scrapes one at a time


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = REQUEST_TIMEOUT_S  # StreamRequestHandler sets it on the connection: no read waits for ever
        super().setup()

    def log_message(self, *args) -> None:  # no line per scrape on the console
        pass


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process at exit

    def __init__(self, address, family: int, max_connections: int):
        self.address_family = family
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the bound: closed now rather than given a thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        # a client that timed out or hung up: its connection is closed, nothing for the log
        log.debug("/metrics connection from %s ended with an error", client_address, exc_info=True)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> _Server:
    """A started /metrics server for `registry` on host:port (0: a free port; an IPv6 host works too)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server = _Server(address[:2], family, MAX_CONNECTIONS)
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


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


class CounterValues:
    """Counters whose totals are kept elsewhere (the rollout buffer's counts in Redis, which outlive the trainer
    process): each `set` gives the current totals by label value, served with the counter type and the `_total`
    suffix. A prometheus_client Counter only counts up from this process's start, and a Gauge holding a count breaks
    the conventions dashboards and `rate()` rely on (a counter is `_total` and typed counter)."""

    def __init__(self, registry: CollectorRegistry, name: str, doc: str, label: str):
        self.name, self.doc, self.label = name, doc, label
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        registry.register(self)

    def set(self, values: dict[str, float]) -> None:
        with self._lock:
            self._values = {str(key): float(value) for key, value in values.items()}

    def describe(self):
        return [CounterMetricFamily(self.name, self.doc, labels=[self.label])]  # names, for the duplicate check

    def collect(self):
        family = CounterMetricFamily(self.name, self.doc, labels=[self.label])
        with self._lock:
            for key, value in sorted(self._values.items()):
                family.add_metric([key], value)
        yield family


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

    def counter_values(self, name: str, doc: str, label: str) -> CounterValues:
        """Counters set from totals kept elsewhere (CounterValues); `name` without `_total`, which is added."""
        return CounterValues(self.registry, PREFIX + name, doc, label)

    def start(self, host: str, port: int | None, setting: str = "metrics_port") -> int | None:
        """Serve on `port` (0 = a free one); None = do not serve. Returns the bound port; OSError naming `setting`
        (the config field of the port) when it cannot be bound."""
        if port is None:
            return None
        try:
            self._server = serve_metrics(self.registry, host, port)
        except OSError as exc:  # the bare "[Errno 98] Address already in use" named neither the port nor the field
            raise OSError(f"{setting}={port}: cannot serve metrics on {host}:{port} ({exc.strerror or exc}); pick "
                          "another port, 0 for a free one, or null for no metrics server") from exc
        self.port = self._server.server_port
        log.info("%s metrics at http://%s:%d/metrics", self.service, host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
