"""The weights data plane's front door: connections wait here, all on one thread, until they presented a token that
may fetch weights and their whole request; only then do they get a transfer slot and a pool thread.

A connection that sends nothing, too little, or a token that is refused holds no slot: it is closed when its
`request_timeout_s` passes (refused ones are answered first), and at most `max_pending` connections wait at once,
the oldest closed first when more arrive, so idle connections without a token can delay no fetch: a sampler
sends its request right after connecting and is through in milliseconds. With TLS the handshake happens here too,
without blocking.
"""

from __future__ import annotations

import dataclasses
import logging
import selectors
import socket
import ssl
import time
from typing import Callable

import grpc

from grpo_stream.common.weights.snapshot import WeightTransferError
from grpo_stream.common.weights.tcp_wire import RequestReader, encode_status

log = logging.getLogger(__name__)
Refusal = tuple[grpc.StatusCode, str]
_CLOSE_LINGER_S = 2.0  # a refused connection is read (and its bytes dropped) this long for the peer to close first
_READ = 65536


@dataclasses.dataclass
class _Waiting:
    sock: socket.socket
    deadline: float
    reader: RequestReader = dataclasses.field(default_factory=RequestReader)
    handshaken: bool = False
    token_checked: bool = False
    closing: bool = False  # answered: we only wait for the peer to close (so it reads the answer, not a reset)


class Intake:
    """Accepts on `listener` until `stopped()`; hands each connection whose token `check_token` passed (None: it
    may) and whose request arrived, to `admit(sock, request_bytes)`, which returns a refusal (the transfer slots
    are full) or None once it took the socket."""

    def __init__(self, listener: socket.socket, check_token: Callable[[str], Refusal | None],
                 admit: Callable[[socket.socket, bytes], Refusal | None], request_timeout_s: float,
                 max_pending: int = 256, ssl_context: ssl.SSLContext | None = None):
        self.listener, self.check_token, self.admit = listener, check_token, admit
        self.request_timeout_s, self.max_pending, self.ssl_context = request_timeout_s, max_pending, ssl_context
        self._selector = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, _Waiting] = {}  # in arrival order: the oldest first

    @property
    def waiting(self) -> int:
        """Connections accepted that have not yet been handed over or closed."""
        return len(self._waiting)

    def run(self, stopped: Callable[[], bool]) -> None:
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        try:
            while not stopped():
                for key, _ in self._selector.select(self._wait_s()):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj in self._waiting:
                        waiting = self._waiting[key.fileobj]
                        try:
                            self._progress(waiting)
                        except Exception:  # noqa: BLE001 - one connection must never stop the data plane
                            log.exception("weights data plane: serving a connection's request failed")
                            self._close(waiting)
                now = time.monotonic()
                for waiting in [w for w in self._waiting.values() if w.deadline <= now]:
                    if not waiting.closing:
                        log.debug("weights data plane: no valid request within %.0fs; closing",
                                  self.request_timeout_s)
                    self._close(waiting)
        finally:
            for waiting in list(self._waiting.values()):
                self._close(waiting)
            self._selector.close()

    def _wait_s(self) -> float:
        """Until the oldest waiting connection's deadline (they arrive in order), at most 0.5 s (to notice stop)."""
        first = next(iter(self._waiting.values()), None)
        return 0.5 if first is None else min(0.5, max(0.0, first.deadline - time.monotonic()))

    def _accept(self) -> None:
        for _ in range(64):  # then serve the waiting ones again
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: closing the oldest below frees one
                log.warning("weights data plane: accept failed (%s)", exc)
                return
            if len(self._waiting) >= self.max_pending:
                self._close(next(iter(self._waiting.values())))
            conn.setblocking(False)
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            waiting = _Waiting(conn, time.monotonic() + self.request_timeout_s, handshaken=self.ssl_context is None)
            self._waiting[conn] = waiting
            self._selector.register(conn, selectors.EVENT_READ)

    def _progress(self, w: _Waiting) -> None:
        """Read what arrived; answer and close, or hand over once the request is complete."""
        try:
            if w.closing:
                if not w.sock.recv(_READ):
                    self._close(w)
                return
            if not w.handshaken:
                w.sock.do_handshake()
                w.handshaken = True
                self._selector.modify(w.sock, selectors.EVENT_READ)
            while w.reader.wanted:
                data = w.sock.recv(min(w.reader.wanted, _READ))
                if not data:
                    self._close(w)
                    return
                w.reader.feed(data)
                if w.reader.token is not None and not w.token_checked:
                    refused = self.check_token(w.reader.token)
                    if refused is not None:
                        self._answer(w, refused)
                        return
                    w.token_checked = True
        except (BlockingIOError, ssl.SSLWantReadError):
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(w.sock, selectors.EVENT_WRITE)
            return
        except WeightTransferError as exc:
            self._answer(w, (grpc.StatusCode.INVALID_ARGUMENT, f"bad data-plane request: {exc}"))
            return
        except (ssl.SSLError, OSError) as exc:  # not TLS, a bad client certificate, a reset
            log.info("weights data plane: connection dropped before its request (%s)", exc)
            self._close(w)
            return
        self._hand_over(w)

    def _hand_over(self, w: _Waiting) -> None:
        self._selector.unregister(w.sock)
        del self._waiting[w.sock]
        w.sock.setblocking(True)
        refused = self.admit(w.sock, w.reader.request)
        if refused is not None:
            self._waiting[w.sock] = w
            w.sock.setblocking(False)
            self._selector.register(w.sock, selectors.EVENT_READ)
            self._answer(w, refused)

    def _answer(self, w: _Waiting, refusal: Refusal) -> None:
        """Send the refusal and stop sending; keep reading (and dropping) until the peer closes or
        _CLOSE_LINGER_S passes, so that it reads the answer instead of a reset for bytes it sent and we did not
        read."""
        code, message = refusal
        try:
            w.sock.send(encode_status(code.value[0], message))  # a few hundred bytes: a fresh socket takes them
            w.sock.shutdown(socket.SHUT_WR)
        except (ssl.SSLError, OSError):
            self._close(w)
            return
        w.closing, w.deadline = True, time.monotonic() + _CLOSE_LINGER_S
        self._selector.modify(w.sock, selectors.EVENT_READ)

    def _close(self, w: _Waiting) -> None:
        self._waiting.pop(w.sock, None)
        try:
            self._selector.unregister(w.sock)
        except (KeyError, ValueError):
            pass
        w.sock.close()
