"""A process that never joined a JAX job, writing into its coordination service's key-value store: what a hostile
neighbour who reaches the coordinator port can do (issue 41, finding 2); and where a coordinator listens. It speaks
the service's gRPC API (xla.coordination.CoordinationService, jaxlib's own coordination_service.proto) with
hand-encoded protobuf, and learns the service incarnation the service wants from the error its first call gets, as
the review did."""

from __future__ import annotations

import pathlib
import re
import struct

import grpc

_SERVICE = "/xla.coordination.CoordinationService/"
# 127.0.0.1, ::ffff:127.0.0.1 and ::1 as /proc/net/tcp and tcp6 write them
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) with a socket listening on `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                out.add(address)
    return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _read_fields(data: bytes) -> list[tuple[int, bytes | int]]:
    """(field number, value) of a protobuf message: bytes for length-delimited fields, ints for varints."""
    out, i = [], 0
    while i < len(data):
        key, i = _read_varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(data, i)
        elif wire == 2:
            size, i = _read_varint(data, i)
            value, i = data[i:i + size], i + size
        elif wire == 1:
            value, i = data[i:i + 8], i + 8
        else:
            raise ValueError(f"wire type {wire}")
        out.append((number, value))
    return out


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not byte & 0x80:
            return value, i


class Intruder:
    """Reads, lists, writes (overwriting) and deletes keys of the coordination service at `address`."""

    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.insecure_channel(address)
        self._incarnation = 0  # the service's, learnt from the first refusal

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, body) -> bytes:
        for _ in range(2):
            try:
                return self._channel.unary_unary(_SERVICE + method)(body(), timeout=10)
            except grpc.RpcError as exc:
                found = re.search(r"wrong service incarnation: requested \d+, currently (\d+)", exc.details() or "")
                if found is None:
                    raise
                self._incarnation = int(found.group(1))
        raise AssertionError("the coordination service refused its own incarnation")

    def _incarnations(self) -> bytes:
        # Incarnations {task_id = 1 (varint), task_incarnation = 2 (fixed64), service_incarnation = 3 (fixed64)}
        return _field(1, _varint(1 << 3) + _varint(1) + _varint(2 << 3 | 1) + struct.pack("<Q", 0)
                      + _varint(3 << 3 | 1) + struct.pack("<Q", self._incarnation))

    def put(self, key: str, value: bytes) -> None:
        """InsertKeyValue with allow_overwrite: the key holds `value` whether or not it existed."""
        entry = _field(1, key.encode()) + _field(2, value)
        self._call("InsertKeyValue", lambda: self._incarnations() + _field(2, entry) + _varint(3 << 3) + b"\x01")

    def listing(self, directory: str) -> dict[str, bytes]:
        """Every key under `directory` (e.g. "grpo/") and its value."""
        raw = self._call("GetKeyValueDir", lambda: self._incarnations() + _field(2, directory.encode()))
        out = {}
        for number, entry in _read_fields(raw):
            if number == 2:
                kv = dict(_read_fields(entry))
                out[kv.get(1, b"").decode()] = kv.get(2, b"")
        return out
