"""The trainer's TCP data plane for weight slices (weights.data_plane=tcp; framing in common/weights/tcp_wire.py).

A listener thread (intake.py) reads each connection's token and request without blocking and checks the
token exactly as FetchSlices does (same statuses and messages); only a connection that passed and asked takes one
of `workers` transfer slots and a pool thread, which checks the request and sends each slice: header, bytes,
checksum. Idle or token-less connections therefore hold no slot. Contiguous slices go out from the host snapshot
itself, without a copy.

A transfer holds its version's host snapshot until it ends, so a peer that stops reading (a frozen sampler, one cut off
by the network, a hostile client) must not hold it long: a piece (4 MiB) the peer does not take within
`stall_timeout_s` ends the transfer, and `stop()` ends every transfer at once (a process exiting would otherwise wait
for their pool threads).
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import ssl
import threading
import time

import grpc
from google.protobuf.message import DecodeError

from grpo_stream.common.rpc.auth import DATA_PLANE, TokenTable, refusal
from grpo_stream.common.weights.tcp_wire import encode_status, send_slice
from grpo_stream.common.weights.snapshot import WeightTransferError, raw_bytes
from grpo_stream.protos import weights_pb2
from grpo_stream.trainer_service.publication.grpc_transport_server.intake import Intake, Refusal
from grpo_stream.trainer_service.publication.grpc_transport_server.slices import FetchRefused, SliceServer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher

log = logging.getLogger(__name__)

STALL_TIMEOUT_S = 60.0  # a peer that takes no bytes of a fetch this long stalled: its transfer ends (WeightService too)


class WeightDataServer:
    """`workers` transfers at a time (an authorized request beyond them gets RESOURCE_EXHAUSTED at once and its
    sampler fetches over gRPC); a connection must send its token and request within `request_timeout_s` (at most
    `max_pending` wait at once, the oldest closed first), a whole transfer finish within `transfer_timeout_s`, and
    each piece of it (4 MiB, tcp_wire.PIECE) be taken by the peer within `stall_timeout_s`."""

    def __init__(self, publisher: WeightPublisher, host: str, port: int = 0, workers: int = 16,
                 request_timeout_s: float = 5.0, transfer_timeout_s: float = 600.0, table: TokenTable | None = None,
                 ssl_context: ssl.SSLContext | None = None, max_pending: int = 256, slices: SliceServer | None = None,
                 stall_timeout_s: float = STALL_TIMEOUT_S):
        """`publisher`: whose held versions it serves, and whose manifests announce its port; `table`: tokens a
        request must carry (None: no auth); `ssl_context`: serve over TLS; `slices`: how a request becomes slices
        and is paced (None: a SliceServer of `publisher` without a rate cap)."""
        self.publisher, self.host, self.port = publisher, host, port
        self.slices = SliceServer(publisher) if slices is None else slices
        self.table, self.ssl_context = table, ssl_context
        self.request_timeout_s, self.transfer_timeout_s, self.workers = request_timeout_s, transfer_timeout_s, workers
        self.max_pending, self.stall_timeout_s = max_pending, stall_timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weights-data")
        self._sock: socket.socket | None = None
        self._intake: Intake | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._active = 0
        self._conns: set[socket.socket] = set()  # the connections of the transfers in progress (ended by stop())
        self.served_bytes = 0

    def start(self) -> int:
        try:
            self._sock = socket.create_server((self.host, self.port), backlog=128)
        except OSError as exc:
            raise OSError(f"weights.data_port={self.port}: cannot bind {self.host}:{self.port} ({exc}); pick "
                          "another port or 0 for a free one") from None
        self.port = self._sock.getsockname()[1]
        self.publisher.data_port = self.port
        self._intake = Intake(self._sock, self._check_token, self._admit, self.request_timeout_s, self.max_pending,
                              self.ssl_context)
        self._thread = threading.Thread(target=self._intake.run, args=(self._stopped.is_set,),
                                        name="weights-data-intake", daemon=True)
        self._thread.start()
        return self.port

    @property
    def active_transfers(self) -> int:
        """Connections holding a transfer slot now (token passed, request in, transfer not yet finished)."""
        with self._lock:
            return self._active

    @property
    def waiting_connections(self) -> int:
        """Connections accepted that have not (yet) sent a token and request that got them a slot."""
        return 0 if self._intake is None else self._intake.waiting

    def stop(self) -> None:
        self._stopped.set()
        self.publisher.data_port = 0
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
        with self._lock:  # no transfer starts once _stopped is set (_admit checks it under this lock)
            conns = list(self._conns)
        for conn in conns:  # a send blocked on a peer that does not read returns at once
            try:
                socket.socket.shutdown(conn, socket.SHUT_RDWR)  # the plain socket's (TLS state left alone)
            except OSError:
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _check_token(self, token: str) -> Refusal | None:
        """As the gRPC interceptor does for FetchSlices: a missing, unknown or wrong-role token is refused."""
        return None if self.table is None else refusal(self.table, token, DATA_PLANE)

    def _admit(self, conn: socket.socket, request: bytes) -> Refusal | None:
        """Give an authorized connection a transfer slot and a pool thread, or say why not."""
        with self._lock:
            if self._active >= self.workers or self._stopped.is_set():
                return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"all {self.workers} data-plane transfers busy; fetch over gRPC or retry")
            self._active += 1
            self._conns.add(conn)
        try:
            self._pool.submit(self._serve, conn, request)
        except RuntimeError:  # stopping
            with self._lock:
                self._active -= 1
                self._conns.discard(conn)
            return grpc.StatusCode.UNAVAILABLE, "the data plane is stopping"
        return None

    def _serve(self, conn: socket.socket, request: bytes) -> None:
        try:
            with conn:
                self._transfer(conn, request)
        except Exception:  # noqa: BLE001 - a transfer must never take the server down
            log.exception("weights data plane: transfer failed")
        finally:
            with self._lock:
                self._active -= 1
                self._conns.discard(conn)

    def _transfer(self, conn: socket.socket, request: bytes) -> None:
        conn.settimeout(self.request_timeout_s)  # until the transfer's own deadline below
        try:
            plan = self.slices.plan(weights_pb2.FetchSlicesRequest.FromString(request))
        except FetchRefused as exc:
            self._refuse(conn, exc.code, exc.message)
            return
        except (WeightTransferError, DecodeError, ValueError) as exc:  # a request that does not parse
            self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, f"bad data-plane request: {exc}")
            return
        deadline = time.monotonic() + self.transfer_timeout_s

        def pace(offset: int) -> None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfer exceeded {self.transfer_timeout_s:.0f}s")
            conn.settimeout(max(0.01, min(self.stall_timeout_s, deadline - time.monotonic())))
            self.slices.pace(sent + offset, start)

        sent, start = 0, time.monotonic()
        try:
            conn.sendall(encode_status(0))
            for t, k, arr, box in plan:
                view = raw_bytes(arr[box])
                send_slice(conn, t, k, view, pace)
                sent += len(view)
        except OSError as exc:  # the sampler gave up (deadline) or went away: its fetch retries
            log.info("weights data plane: transfer to a sampler stopped (%s)", exc)
        with self._lock:
            self.served_bytes += sent

    @staticmethod
    def _refuse(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        try:
            conn.sendall(encode_status(code.value[0], message))
        except OSError:
            pass
