"""Calls that never finish sending, as a hostile peer opens them: a call's headers, then no request at all
(`HalfSentCalls`, with grpcio: a request iterator that blocks; the server cannot tell a unary method called so
from a unary call whose request is late) or the first bytes of a request that never completes (`PartialBodies`,
hand-written HTTP/2 frames on a raw socket: grpcio only sends whole messages, and no HTTP/2 library is installed).
"""

from __future__ import annotations

import socket
import struct
import threading

import grpc

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PING, _GOAWAY = 0, 1, 3, 4, 6, 7
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1


class HalfSentCalls:
    """Half-sent calls on their own connections (`per_connection` calls each: the server lets one connection have
    only so many streams open, and grpcio queues the rest in the client), all open until `close()`."""

    def __init__(self, address: str, per_connection: int = 100):
        self.address, self.per_connection = address, per_connection
        self.release = threading.Event()
        self.calls: list[tuple[str, str, grpc.Future]] = []  # (what, path, call)
        self._channels: list[grpc.Channel] = []

    def _channel(self) -> grpc.Channel:
        if not self._channels or len(self.calls) % self.per_connection == 0:
            # a local subchannel pool: a connection of its own, not one shared with the other channels
            channel = grpc.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])
            grpc.channel_ready_future(channel).result(timeout=10)  # so each call reaches the server as it is opened
            self._channels.append(channel)
        return self._channels[-1]

    def _blocked(self, first: bytes | None):
        if first is not None:
            yield first
        self.release.wait()

    def open(self, what: str, path: str, token: str | None, response_streaming: bool = False,
             first: bytes | None = None) -> grpc.Future:
        """A call of `path` that sends its headers (with `token`), `first` if given, and then nothing."""
        channel = self._channel()
        metadata = [("authorization", f"Bearer {token}")] if token else None
        ident = lambda b: b  # noqa: E731
        if response_streaming:
            call = channel.stream_stream(path, request_serializer=ident, response_deserializer=ident)(
                self._blocked(first), metadata=metadata)
        else:
            call = channel.stream_unary(path, request_serializer=ident, response_deserializer=ident).future(
                self._blocked(first), metadata=metadata)
        self.calls.append((what, path, call))
        return call

    def outcomes(self) -> dict[str, dict[str, int]]:
        """what -> {status name or 'open': count}."""
        out: dict[str, dict[str, int]] = {}
        for what, _, call in self.calls:
            status = call.code().name if call.done() else "open"
            out.setdefault(what, {}).setdefault(status, 0)
            out[what][status] += 1
        return out

    def still_open(self) -> int:
        return sum(not call.done() for _, _, call in self.calls)

    def close(self) -> None:
        self.release.set()
        for _, _, call in self.calls:
            call.cancel()
        for channel in self._channels:
            channel.close()


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _hpack_int(value: int, prefix_bits: int = 7) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([value])
    out, value = bytearray([limit]), value - limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    return bytes(out + bytes([value]))


def _hpack(headers: list[tuple[str, str]]) -> bytes:
    """Each header as a literal without indexing, new name, no Huffman (RFC 7541 6.2.2)."""
    out = bytearray()
    for name, value in headers:
        out += b"\x00" + _hpack_int(len(name)) + name.encode() + _hpack_int(len(value)) + value.encode()
    return bytes(out)


class PartialBodies:
    """One raw HTTP/2 connection whose `streams` calls of `path` each send headers and the first bytes of a
    message that announces 1,000 bytes and never gets them. It answers the server's SETTINGS and PINGs (a peer that
    seems alive), and records how the server first ended each stream: 'answered' (a status, e.g. a refusal) or
    'reset' (RST_STREAM: cancelled, or refused beyond the connection's stream limit)."""

    def __init__(self, host: str, port: int, path: str, token: str | None, streams: int):
        self.sock = socket.create_connection((host, port), timeout=10)
        self.ended: dict[int, str] = {}
        self.refused_streams = 0
        self._lock = threading.Lock()
        self.sock.sendall(_PREFACE + _frame(_SETTINGS, 0, 0))
        while self._read_frame() != _SETTINGS:  # open the streams once the server's limits apply (acknowledged)
            pass
        self.sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, daemon=True, name="partial-bodies")
        self._reader.start()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", f"{host}:{port}"),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        if token:
            headers.append(("authorization", f"Bearer {token}"))
        block = _hpack(headers)
        self.streams = [2 * i + 1 for i in range(streams)]
        for stream in self.streams:
            self.sock.sendall(_frame(_HEADERS, _END_HEADERS, stream, block) +
                              _frame(_DATA, 0, stream, b"\x00" + struct.pack(">I", 1000) + b"only this"))

    def _read_frame(self) -> int | None:
        head = self._recv(9)
        length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
        stream = struct.unpack(">I", head[5:])[0] & 0x7FFFFFFF
        payload = self._recv(length)
        if kind == _SETTINGS and not flags & _ACK:
            self.sock.sendall(_frame(_SETTINGS, _ACK, 0))
        elif kind == _PING and not flags & _ACK:
            self.sock.sendall(_frame(_PING, _ACK, 0, payload))
        elif kind == _RST_STREAM:
            with self._lock:
                self.ended.setdefault(stream, "reset")
                self.refused_streams += struct.unpack(">I", payload)[0] == 7  # REFUSED_STREAM
        elif kind in (_HEADERS, _DATA) and flags & _END_STREAM:
            with self._lock:
                self.ended.setdefault(stream, "answered")
        elif kind == _GOAWAY:
            raise ConnectionError("the server sent GOAWAY")
        return kind

    def _recv(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the server closed the connection")
            buf += chunk
        return buf

    def _read(self) -> None:
        try:
            while True:
                self._read_frame()
        except OSError:  # closed: by us in close(), or by the server
            pass

    def outcome(self) -> dict[str, int]:
        """'answered' / 'reset' / 'open' -> streams."""
        with self._lock:
            ended = dict(self.ended)
        out = {"answered": 0, "reset": 0, "open": 0}
        for stream in self.streams:
            out[ended.get(stream, "open")] += 1
        return out

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
