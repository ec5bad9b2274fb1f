"""The TCP data plane of weights.transport=grpc (weights.data_plane=tcp): slice bytes without gRPC framing.

gRPC carries the manifest, the version reports and health; this plane carries only the bytes of the slices a
sampler asked for, as the one copy the kernel makes, straight into preallocated arrays. On this 2-core machine
gRPC streaming tops out near a third of a raw socket's bytes/s (BENCHMARKS.md), which is what this avoids.

One connection per fetch lane:
  client -> server  MAGIC, u16 length, the bearer token (UTF-8; empty without auth), u32 length, a
                    FetchSlicesRequest (protobuf; never pickled)
  server -> client  u32 status (0 = OK, else a grpc.StatusCode value), u32 length, UTF-8 message;
                    then, if OK, for every requested slice in request order:
                    u32 tensor_index, u32 slice_index, u64 nbytes, nbytes raw C-order bytes, u64 XXH3-64 of them.
With tls.enabled the connection is TLS with the gRPC server's certificate; the token is checked as for
FetchSlices (UNAUTHENTICATED / PERMISSION_DENIED before any byte of weights is sent), as soon as it arrived and
before the request is read; a connection takes a transfer slot only once its token passed and its request is in.
The checksum trails the bytes so both sides hash piece by piece while the bytes stream (XXH3 runs at ~20 GB/s
here, CRC-32 at ~4 GB/s, which would cost as much as the copy itself).
"""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import xxhash

from grpo_stream.common.weights.snapshot import WeightTransferError

MAGIC = b"GSW2"  # GSW1 had no token
MAX_TOKEN_BYTES = 4096
_TOKEN_LEN = struct.Struct("<H")
MAX_REQUEST_BYTES = 1 << 20  # a request lists slice bounds: kilobytes even for 70B models
MAX_STATUS_BYTES = 65536
_LEN = struct.Struct("<I")
_STATUS = struct.Struct("<II")
SLICE_HEADER = struct.Struct("<IIQ")
SLICE_TRAILER = struct.Struct("<Q")
PIECE = 4 << 20


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline=deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, hasher=None, deadline: float | None = None) -> None:
    """Fill `view` from the socket (raises ConnectionError on a short read, TimeoutError past `deadline`, a
    time.monotonic() value), feeding `hasher` piece by piece while the bytes are still in cache."""
    got, total = 0, len(view)
    while got < total:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"weights data plane: deadline passed after {got} of {total} bytes")
            sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:got + PIECE], min(total - got, PIECE))
        except TimeoutError:  # the socket's own "timed out" names neither the plane nor the deadline
            raise TimeoutError(f"weights data plane: deadline passed after {got} of {total} bytes (slices: the "
                               "fetch's sampler.rpc_timeout_s; the trainer's answer: 10 s at most); is the trainer "
                               "overloaded, or weights.max_serve_mb_s too low for the version's size?") from None
        if not n:
            raise ConnectionError(f"weights data plane closed after {got} of {total} bytes")
        if hasher is not None:
            hasher.update(view[got:got + n])
        got += n


def send_slice(sock: socket.socket, tensor_index: int, slice_index: int, view: memoryview, pace=None) -> None:
    """Header, bytes (in pieces; `pace(bytes_sent_so_far)` may sleep between them) and trailing checksum."""
    sock.sendall(SLICE_HEADER.pack(tensor_index, slice_index, len(view)))
    hasher = xxhash.xxh3_64()
    for offset in range(0, len(view), PIECE):
        if pace is not None:
            pace(offset)
        piece = view[offset:offset + PIECE]
        hasher.update(piece)
        sock.sendall(piece)
    sock.sendall(SLICE_TRAILER.pack(hasher.intdigest()))


def token_fits(token: str | None) -> bool:
    """Whether `token` fits the data plane's token field (gRPC metadata takes longer ones: such a client fetches
    over FetchSlices instead)."""
    return len((token or "").encode()) <= MAX_TOKEN_BYTES


def encode_request(request_bytes: bytes, token: str | None = None) -> bytes:
    """A request frame. A token longer than MAX_TOKEN_BYTES raises WeightTransferError: cut short it would be
    refused as an unknown token, which a sampler takes for a permanent refusal."""
    if not token_fits(token):
        raise WeightTransferError(f"the auth token is {len((token or '').encode())} bytes, more than the weights data "
                                  f"plane's {MAX_TOKEN_BYTES}; fetch over gRPC, or use a shorter token "
                                  "(`grpo-stream tokens` makes 43-character ones)")
    raw_token = (token or "").encode()
    return MAGIC + _TOKEN_LEN.pack(len(raw_token)) + raw_token + _LEN.pack(len(request_bytes)) + request_bytes


class RequestReader:
    """A request parsed as its bytes arrive (the server reads every connection that has not yet asked on one thread,
    without blocking): `feed` at most `wanted` bytes at a time; `token` is set as soon as the token is in, so the
    server checks it before it reads (or buffers) a request, and `request` (a serialized FetchSlicesRequest) once
    all of it is. WeightTransferError for anything that is not such a request."""

    _HEAD, _TOKEN, _LENGTH, _REQUEST = range(4)

    def __init__(self):
        self.token: str | None = None
        self.request: bytes | None = None
        self._buf = bytearray()
        self._stage, self._need = self._HEAD, len(MAGIC) + _TOKEN_LEN.size

    @property
    def wanted(self) -> int:
        """Bytes still to read before the next part is complete (0 once the request is)."""
        return 0 if self.request is not None else self._need - len(self._buf)

    def feed(self, data: bytes) -> None:
        self._buf += data
        while self.request is None and len(self._buf) >= self._need:
            part = bytes(self._buf[:self._need])
            del self._buf[:self._need]
            self._advance(part)

    def _advance(self, part: bytes) -> None:
        if self._stage == self._HEAD:
            if part[:len(MAGIC)] != MAGIC:
                raise WeightTransferError("not a grpo-stream weights data-plane request (bad magic); is the client "
                                          "pointed at the right port, and of the same grpo-stream version?")
            (token_length,) = _TOKEN_LEN.unpack(part[len(MAGIC):])
            if token_length > MAX_TOKEN_BYTES:
                raise WeightTransferError(f"token of {token_length} bytes exceeds {MAX_TOKEN_BYTES}")
            self._stage, self._need = self._TOKEN, token_length
        elif self._stage == self._TOKEN:
            self.token = part.decode(errors="replace")
            self._stage, self._need = self._LENGTH, _LEN.size
        elif self._stage == self._LENGTH:
            (length,) = _LEN.unpack(part)
            if length > MAX_REQUEST_BYTES:
                raise WeightTransferError(f"request of {length} bytes exceeds {MAX_REQUEST_BYTES}")
            self._stage, self._need = self._REQUEST, length
        else:
            self.request = part


def encode_status(code: int, message: str = "") -> bytes:
    text = message.encode()[:MAX_STATUS_BYTES]
    return _STATUS.pack(code, len(text)) + text


def read_status(sock: socket.socket, deadline: float) -> tuple[int, str]:
    code, length = _STATUS.unpack(recv_exact(sock, _STATUS.size, deadline))
    if length > MAX_STATUS_BYTES:
        raise WeightTransferError(f"weights data plane: status message of {length} bytes; is "
                                  "sampler.trainer_address pointing at a grpo-stream trainer?")
    return code, recv_exact(sock, length, deadline).decode(errors="replace")


def receive_slice(sock: socket.socket, tensor_index: int, slice_index: int, out: np.ndarray, name: str,
                  deadline: float) -> None:
    """Receive the next slice into `out` (C-contiguous, of the slice's shape and wire dtype), checking that it is
    the one expected, its size and its checksum."""
    t, k, nbytes = SLICE_HEADER.unpack(recv_exact(sock, SLICE_HEADER.size, deadline))
    if (t, k) != (tensor_index, slice_index) or nbytes != out.nbytes:
        raise WeightTransferError(f"{name}: data plane sent tensor {t} slice {k} ({nbytes} bytes), expected tensor "
                                  f"{tensor_index} slice {slice_index} ({out.nbytes} bytes)")
    hasher = xxhash.xxh3_64()
    recv_into_exact(sock, memoryview(out.reshape(-1).view(np.uint8)), hasher, deadline)
    (digest,) = SLICE_TRAILER.unpack(recv_exact(sock, SLICE_TRAILER.size, deadline))
    if digest != hasher.intdigest():
        raise WeightTransferError(f"{name}: slice {slice_index} failed its checksum on the data plane")
