"""gRPC plumbing shared by every server and client: message-size limits, TLS, bearer tokens, call limits, health and
reflection.

Servers are made with `new_server` + `bind` and clients with `open_channel`, so every one of them gets the same
limits and the same security (config sections `auth`, `tls` and `rpc`).
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import logging
import pathlib
import resource
import ssl
from concurrent import futures

import grpc

from grpo_stream.common.config.access import MAX_MESSAGE_BYTES
from grpo_stream.common.rpc.auth import AuthError, TokenTable, load_table, own_token
from grpo_stream.common.rpc.call_guard import CallLimits, GuardInterceptor

log = logging.getLogger(__name__)


CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a client pings a connection with calls open every 20 s, so a call to a server that froze or vanished without
    # closing the connection (a lost host: the kernel keeps it open for hours) ends within ~40 s. Both settings
    # below are needed, tried on grpc 1.85: by default no more than 2 pings go out while no data does, so a quiet
    # stream (a follower waiting minutes for results) stopped pinging after 40 s and then waited forever; and an
    # unanswered ping is given up on after ping_timeout_ms (default 60 s), not keepalive_timeout_ms
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.ping_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    # clients ping every 20 s (CHANNEL_OPTIONS); a quiet stream (following results that take minutes) must not be
    # answered with GOAWAY "too_many_pings", which the default 5-minute minimum would do
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # the server pings quiet connections too, so the calls (and call slots, call_guard.py) of a peer that vanished
    # or stopped answering without closing its connection end within ~80 s instead of the kernel's hours; pings
    # without data unlimited, since a call waiting for results sends none. grpc 1.85 closes on an unanswered ping
    # after ping_timeout_ms (keepalive_timeout_ms alone did not, tried against a peer that never answers)
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.ping_timeout_ms", 20_000),
    ("grpc.http2.max_pings_without_data", 0),
]


# Connections one server holds at once (grpc.max_allowed_incoming_connections; beyond it a new one is closed as
# accepted, and its client retries). Without a cap, a peer without any token opened connections until the process
# ran out of file descriptors (1,100 idle connections took a server with the usual soft limit of 1,024 to EMFILE:
# no checkpoint, Redis or data-plane socket could be opened). A sampler holds one or two.
MAX_CONNECTIONS = 1024
# Groups one Admit grants and injected prompts one ClaimPrompts hands out, at most: the ingest refuses a larger count
# (INVALID_ARGUMENT) and a sampler asks for no more (with more room, the rest at its next look)
MAX_CLAIM = 4096


def connection_cap() -> int:
    """Raises this process's soft RLIMIT_NOFILE toward its hard limit to twice MAX_CONNECTIONS, and returns the
    connections a server may hold: MAX_CONNECTIONS, or half the open-file limit where the hard limit is lower
    (logged), so that the other half stays for the process's own files and sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * MAX_CONNECTIONS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if raised > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return MAX_CONNECTIONS
    log.warning("the open-file limit (%d, hard %s) leaves room for %d client connections per gRPC server, not %d "
                "(raise the hard limit: ulimit -Hn)", soft, hard, soft // 2, MAX_CONNECTIONS)
    return max(16, soft // 2)


def _read(path: str | None, setting: str) -> bytes | None:
    if path is None:
        return None
    try:
        return pathlib.Path(path).read_bytes()
    except OSError as exc:
        raise AuthError(f"{setting}={path}: cannot read it ({exc.strerror})") from None


@dataclasses.dataclass(frozen=True)
class ServerSecurity:
    """What a server checks: the token table (None: no auth) and TLS credentials (None: plaintext)."""

    table: TokenTable | None = None
    open_health: bool = False
    tls: grpc.ServerCredentials | None = None
    ssl_context: ssl.SSLContext | None = None  # the same certificate for the weights TCP data plane
    plaintext_bind: str = "warn"  # tls.plaintext_bind: what a plaintext bind beyond loopback does
    limits: CallLimits = dataclasses.field(default_factory=CallLimits)  # calls served at once (config rpc)

    @classmethod
    def from_config(cls, cfg) -> "ServerSecurity":
        tls = cfg.tls
        creds = context = None
        if tls.enabled:
            if not (tls.cert_file and tls.key_file):
                raise AuthError("tls.enabled: servers need tls.cert_file and tls.key_file")
            key, cert = _read(tls.key_file, "tls.key_file"), _read(tls.cert_file, "tls.cert_file")
            ca = _read(tls.ca_file, "tls.ca_file")
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                                require_client_auth=tls.require_client_cert)
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cadata=ca.decode() if ca else None)
            context.load_cert_chain(tls.cert_file, tls.key_file)
            context.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE
        return cls(load_table(cfg.auth), cfg.auth.open_health, creds, context, tls.plaintext_bind,
                   CallLimits.from_config(cfg))


@dataclasses.dataclass(frozen=True)
class ClientSecurity:
    """What a client presents: its bearer token (None: none) and TLS settings (None: plaintext)."""

    token: str | None = dataclasses.field(default=None, repr=False)  # a secret: never in logs or tracebacks
    tls: grpc.ChannelCredentials | None = None
    server_name: str | None = None
    ssl_context: ssl.SSLContext | None = None

    @classmethod
    def from_config(cls, cfg, token: str | None = None) -> "ClientSecurity":
        """`token` overrides the configured source (e.g. `grpo-stream submit --token-file`)."""
        tls = cfg.tls
        creds = context = None
        if tls.enabled:
            ca = _read(tls.ca_file, "tls.ca_file")
            key, cert = _read(tls.client_key_file, "tls.client_key_file"), _read(tls.client_cert_file,
                                                                                  "tls.client_cert_file")
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            context = ssl.create_default_context(cadata=ca.decode() if ca else None)
            if cert:
                context.load_cert_chain(tls.client_cert_file, tls.client_key_file)
        return cls(token if token is not None else own_token(cfg.auth), creds, tls.server_name, context)


def new_server(security: ServerSecurity | None) -> grpc.Server:
    """A server whose every call passes call_guard.py: auth when `security` has a token table, and the call limits
    of `security.limits` (defaults without `security`). Its pool holds every kind's slots plus the threads that
    answer refusals, and a call beyond that is answered RESOURCE_EXHAUSTED at once (maximum_concurrent_rpcs). It holds
    at most `connection_cap()` client connections."""
    security = security or ServerSecurity()
    limits = security.limits
    guard = GuardInterceptor(security.table, limits, security.open_health)
    options = [*SERVER_OPTIONS, ("grpc.max_concurrent_streams", limits.streams_per_connection),
               ("grpc.max_allowed_incoming_connections", connection_cap())]
    return grpc.server(futures.ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="grpc-server"),
                       options=options, interceptors=[guard], maximum_concurrent_rpcs=limits.workers)


def is_loopback(host: str) -> bool:
    """Whether a listen address reaches this machine only (0.0.0.0, '::' and '' listen on every interface)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def check_plaintext_bind(host: str, security: ServerSecurity | None, setting: str) -> None:
    """Warn (or, with tls.plaintext_bind=refuse, raise naming it) when a server without TLS listens beyond
    loopback: its clients' bearer tokens, rollouts and weights cross the network in the clear."""
    if is_loopback(host) or (security is not None and (security.tls is not None or security.ssl_context is not None)):
        return
    what = (f"{setting} listens on {host or 'every interface'} without TLS: bearer tokens, rollouts and weights "
            "cross the network in plaintext")
    if security is not None and security.plaintext_bind == "refuse":
        raise OSError(f"{what}; turn on tls.enabled (with tls.cert_file and tls.key_file), bind a loopback "
                      "address, or set tls.plaintext_bind=warn on a network you trust")
    log.warning("%s; turn on tls.enabled, or set tls.plaintext_bind=refuse to make this an error", what)


def bind(server: grpc.Server, host: str, port: int, security: ServerSecurity | None, setting: str) -> int:
    """Listen on host:port (TLS when configured); OSError naming `setting` when the port cannot be bound."""
    check_plaintext_bind(host, security, setting)
    address = f"{host}:{port}"
    bound = (server.add_secure_port(address, security.tls) if security is not None and security.tls is not None
             else server.add_insecure_port(address))
    if bound == 0:
        raise OSError(f"{setting}={port}: cannot bind {address} (in use?); pick another port or 0 for a free one")
    return bound


def enable_reflection(server: grpc.Server, service_names: list[str]) -> None:
    """Server reflection (grpcurl list/describe) for `service_names` plus health and reflection itself."""
    from grpc_reflection.v1alpha import reflection  # noqa: PLC0415 - deferred: only where reflection is on

    reflection.enable_server_reflection([*service_names, "grpc.health.v1.Health", reflection.SERVICE_NAME], server)


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds 'authorization: Bearer <token>' to every call (works on plaintext channels too, unlike call
    credentials, so auth does not depend on TLS being on)."""

    def __init__(self, token: str):
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d):
        return _Details(d.method, d.timeout, [*(d.metadata or ()), self.header], d.credentials, d.wait_for_ready,
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def open_channel(address: str, security: ClientSecurity | None) -> grpc.Channel:
    options = list(CHANNEL_OPTIONS)
    if security is not None and security.tls is not None:
        if security.server_name:
            options.append(("grpc.ssl_target_name_override", security.server_name))
        channel = grpc.secure_channel(address, security.tls, options=options)
    else:
        channel = grpc.insecure_channel(address, options=options)
    if security is not None and security.token:
        channel = grpc.intercept_channel(channel, _BearerToken(security.token))
    return channel
