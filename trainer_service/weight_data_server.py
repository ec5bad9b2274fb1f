"""The trainer's TCP data plane for weight slices (weights.data_plane=tcp; framing in common/weights/tcp_wire.py).

A listener thread accepts connections; each is served on a pool thread: read one FetchSlicesRequest, check it
exactly as FetchSlices does (same statuses and messages), then send each slice: header, bytes, checksum.
Contiguous slices go out from the host snapshot itself, without a copy.
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
from grpo_stream.common.weights.tcp_wire import encode_status, read_request, send_slice
from grpo_stream.common.weights.snapshot import WeightTransferError, raw_bytes
from grpo_stream.protos import weights_pb2
from grpo_stream.trainer_service.publisher import FetchRefused, WeightPublisher

log = logging.getLogger(__name__)
_SEND_PIECE = 4 << 20


class WeightDataServer:
    """`workers` transfers at a time (more connections get RESOURCE_EXHAUSTED at once and fetch over gRPC);
    a request must arrive within `request_timeout_s` and a whole transfer finish within `transfer_timeout_s`."""

    def __init__(self, publisher: WeightPublisher, host: str, port: int = 0, workers: int = 16,
                 request_timeout_s: float = 10.0, transfer_timeout_s: float = 600.0, table: TokenTable | None = None,
                 ssl_context: ssl.SSLContext | None = None):
        """`table`: tokens a request must carry (None: no auth); `ssl_context`: serve over TLS."""
        self.publisher, self.host, self.port = publisher, host, port
        self.table, self.ssl_context = table, ssl_context
        self.request_timeout_s, self.transfer_timeout_s, self.workers = request_timeout_s, transfer_timeout_s, workers
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weights-data")
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._active = 0
        self.served_bytes = 0

    def start(self) -> int:
        try:
            self._sock = socket.create_server((self.host, self.port), backlog=64)
        except OSError as exc:
            raise OSError(f"weights.data_port={self.port}: cannot bind {self.host}:{self.port} ({exc}); pick "
                          "another port or 0 for a free one") from None
        self.port = self._sock.getsockname()[1]
        self._sock.settimeout(0.5)  # so the accept loop notices stop()
        self.publisher.data_port = self.port
        self._thread = threading.Thread(target=self._accept, name="weights-data-accept", daemon=True)
        self._thread.start()
        return self.port

    @property
    def active_transfers(self) -> int:
        """Connections holding a transfer slot now (accepted, not yet finished)."""
        with self._lock:
            return self._active

    def stop(self) -> None:
        self._stopped.set()
        self.publisher.data_port = 0
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # e.g. out of file descriptors: keep serving once it passes
                if self._stopped.is_set():
                    return
                log.warning("weights data plane: accept failed (%s); retrying", exc)
                time.sleep(0.2)
                continue
            with self._lock:
                busy = self._active >= self.workers
                if not busy:
                    self._active += 1
            if busy:
                conn.settimeout(1.0)
                self._refuse(conn, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"all {self.workers} data-plane transfers busy; fetch over gRPC or retry")
                conn.close()
                continue
            try:
                self._pool.submit(self._serve, conn)
            except RuntimeError:  # stopping
                conn.close()
                return

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.ssl_context is not None:
                conn.settimeout(self.request_timeout_s)
                try:
                    conn = self.ssl_context.wrap_socket(conn, server_side=True)
                except (ssl.SSLError, OSError) as exc:  # not TLS, a bad client certificate, or too slow
                    log.info("weights data plane: TLS handshake refused (%s)", exc)
                    conn.close()
                    return
            with conn:
                self._transfer(conn)
        except Exception:  # noqa: BLE001 - a transfer must never take the server down
            log.exception("weights data plane: transfer failed")
        finally:
            with self._lock:
                self._active -= 1

    def _transfer(self, conn: socket.socket) -> None:
        try:
            token, raw = read_request(conn, time.monotonic() + self.request_timeout_s)
            self._authorize(token)
            plan = self.publisher.plan(weights_pb2.FetchSlicesRequest.FromString(raw))
        except FetchRefused as exc:
            self._refuse(conn, exc.code, exc.message)
            return
        except (WeightTransferError, DecodeError, ValueError) as exc:  # bad framing or protobuf
            self._refuse(conn, grpc.StatusCode.INVALID_ARGUMENT, f"bad data-plane request: {exc}")
            return
        except OSError as exc:  # includes timeouts: the client did not ask in time
            log.debug("weights data plane: no request (%s)", exc)
            return
        deadline = time.monotonic() + self.transfer_timeout_s

        def pace(offset: int) -> None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfer exceeded {self.transfer_timeout_s:.0f}s")
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            self.publisher.pace(sent + offset, start)

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

    def _authorize(self, token: str) -> None:
        """As the gRPC interceptor does for FetchSlices: raises FetchRefused for a missing, unknown or wrong-role
        token."""
        refused = None if self.table is None else refusal(self.table, token, DATA_PLANE)
        if refused is not None:
            raise FetchRefused(*refused)

    @staticmethod
    def _refuse(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
        try:
            conn.sendall(encode_status(code.value[0], message))
        except OSError:
            pass
