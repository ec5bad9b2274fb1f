"""The data plane's request parser, fed as a slow or hostile peer sends: byte by byte, the token known before any
byte of the request is read (so a refused token is answered without reading it), and framing that is not a
request refused naming what is wrong."""

import pytest

from grpo_stream.common.weights import tcp_wire
from grpo_stream.common.weights.snapshot import WeightTransferError


def test_a_request_fed_byte_by_byte_gives_its_token_before_its_request():
    wire = tcp_wire.encode_request(b"\x08\x07request-bytes", "token-0123456789")
    reader, token_seen_at = tcp_wire.RequestReader(), None
    for i, byte in enumerate(wire):
        assert 0 < reader.wanted <= len(wire) - i  # never asks for more than the request still holds
        reader.feed(bytes([byte]))
        if reader.token is not None and token_seen_at is None:
            token_seen_at = i
    assert reader.token == "token-0123456789" and reader.request == b"\x08\x07request-bytes" and reader.wanted == 0
    assert token_seen_at == len(tcp_wire.MAGIC) + 2 + len("token-0123456789") - 1  # before the request's length


def test_empty_token_and_empty_request_are_complete():
    reader = tcp_wire.RequestReader()
    reader.feed(tcp_wire.encode_request(b"", None))
    assert reader.token == "" and reader.request == b"" and reader.wanted == 0


@pytest.mark.parametrize("wire, message", [
    (b"HTTP/1.1 GET /", "bad magic"),
    (tcp_wire.MAGIC + (tcp_wire.MAX_TOKEN_BYTES + 1).to_bytes(2, "little"), "token of 4097 bytes"),
    (tcp_wire.MAGIC + b"\x00\x00" + (tcp_wire.MAX_REQUEST_BYTES + 1).to_bytes(4, "little"), "exceeds"),
])
def test_what_is_not_a_request_is_refused_before_it_is_buffered(wire, message):
    reader = tcp_wire.RequestReader()
    with pytest.raises(WeightTransferError, match=message):
        reader.feed(wire)


def test_a_peer_that_stalls_mid_slice_fails_the_receive_naming_the_deadline():
    import socket
    import time

    import numpy as np

    here, there = socket.socketpair()
    with here, there:
        there.sendall(tcp_wire.SLICE_HEADER.pack(0, 0, 48) + b"x" * 10)  # then nothing more
        with pytest.raises(TimeoutError, match=r"deadline passed after 10 of 48 bytes \(slices: the fetch's sampler.rpc_timeout_s"):
            tcp_wire.receive_slice(here, 0, 0, np.empty((3, 4), np.float32), "w", time.monotonic() + 0.2)
