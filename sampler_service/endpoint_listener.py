"""The endpoint's listener against strangers: uvicorn's HTTP protocol with a deadline for every request head and caps
on open connections (in all, and per client address), and the sampler's open-file limit raised so that what the
endpoint may hold never takes the descriptors its own work needs (weight fetches, gRPC, Redis).

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a connection that never completes a
request head is held for ever (uvicorn stops its keep-alive timer at a head's first byte), and it accepts every
connection: about a thousand token-less half-requests took a sampler to its 1,024 descriptors (its clients reset, its
weight fetch failing with "Too many open files"). Here a connection beyond a cap is closed as it is accepted, and one
whose request head (its first, or a later one on a kept-alive connection) is not complete within `header_timeout_s`
of its start is closed then. Bodies have their own deadline in the app (common/endpoint/app.py).

An answer has one too: a client that stops taking its answer (it never reads, its window stays shut) held the
connection, and the answer's bytes in the sampler's memory, for ever: uvicorn waits for a paused transport without a
deadline, and closes one with unsent bytes (keep-alive timeout, `Connection: close`) only once they are sent. Here
a connection whose unsent answer bytes have not shrunk for `send_timeout_s` (the writes paused, or the answer
complete with bytes still queued) is aborted, freeing both.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import resource

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
OWN_DESCRIPTORS = 512  # kept for the sampler's own work, whatever the endpoint's caps say


@dataclasses.dataclass
class ConnectionLimits:
    """The caps, and the connections open now by client address (shared by every connection of one server; uvicorn
    runs them on one event loop thread, so no lock)."""

    header_timeout_s: float
    max_connections: int
    max_per_address: int
    send_timeout_s: float = 30.0
    open_by_address: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    refused: int = 0
    timed_out: int = 0
    send_timed_out: int = 0  # connections aborted for not taking their answer

    def open_now(self) -> int:
        return sum(self.open_by_address.values())


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the caps and the head and send deadlines of `_limits` (module docstring);
    `guarded_protocol` makes the subclass of one endpoint's limits."""
    _limits: ConnectionLimits
    _send_deadline = None
    _unsent = 0  # unsent answer bytes when the send deadline was armed
    _address: str | None = None
    _head_deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        address, limits = self.client[0] if self.client else "unknown", self._limits
        if limits.open_now() >= limits.max_connections or limits.open_by_address[address] >= limits.max_per_address:
            limits.refused += 1
            if limits.refused in (1, 100, 10_000):
                log.warning("endpoint: connection from %s closed at once: %d open (sampler.openai."
                            "max_connections=%d), %d from it (max_connections_per_address=%d); %d refused so far",
                            address, limits.open_now(), limits.max_connections, limits.open_by_address[address],
                            limits.max_per_address, limits.refused)
            transport.abort()
            return
        self._address = address
        limits.open_by_address[address] += 1
        self._head_deadline = self.loop.call_later(limits.header_timeout_s, self._head_overdue)

    def _between_requests(self) -> bool:
        """No request is being handled: the connection waits for its next head (its first, or one after a
        kept-alive answer)."""
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._between_requests():  # a head is complete
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None
        elif self._head_deadline is None and not self.transport.is_closing():
            # a later head has begun on a kept-alive connection: uvicorn stopped its keep-alive timer at its first
            # byte, so without a deadline of its own an unfinished one would hold the connection for ever
            self._head_deadline = self.loop.call_later(self._limits.header_timeout_s, self._head_overdue)

    def connection_lost(self, exc) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        self._disarm_send()
        if self._address is not None:
            self._limits.open_by_address[self._address] -= 1
            if self._limits.open_by_address[self._address] <= 0:
                del self._limits.open_by_address[self._address]
            self._address = None
        super().connection_lost(exc)

    def _head_overdue(self) -> None:
        self._head_deadline = None
        if self._between_requests() and not self.transport.is_closing():
            self._limits.timed_out += 1
            self.transport.abort()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_send()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send()  # the client took bytes: a fresh deadline for what is still queued
        if self._between_requests() and self.transport.get_write_buffer_size():
            self._arm_send()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.get_write_buffer_size():  # the answer is queued, not sent: it must be taken in time
            self._arm_send()

    def _arm_send(self) -> None:
        if self._send_deadline is None:
            self._unsent = self.transport.get_write_buffer_size()
            self._send_deadline = self.loop.call_later(self._limits.send_timeout_s, self._send_overdue)

    def _disarm_send(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _send_overdue(self) -> None:
        self._send_deadline = None
        unsent = self.transport.get_write_buffer_size()
        if unsent == 0:
            return
        if unsent < self._unsent:  # taken, slowly: another period for the rest
            self._arm_send()
            return
        self._limits.send_timed_out += 1
        if self._limits.send_timed_out in (1, 100, 10_000):
            log.warning("endpoint: connection from %s aborted: %d bytes of its answer not taken within "
                        "sampler.openai.body_timeout_s=%s; %d so far", self._address, unsent,
                        self._limits.send_timeout_s, self._limits.send_timed_out)
        self.transport.abort()


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with `limits` (uvicorn.Config(http=...) takes the class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"_limits": limits})


def raise_open_files(wanted_connections: int) -> int:
    """Raises this process's soft RLIMIT_NOFILE toward its hard limit so that `wanted_connections` fit beside
    OWN_DESCRIPTORS; returns how many connections the endpoint may hold (fewer than wanted where the hard limit is
    too low, logged)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = wanted_connections + OWN_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    allowed = wanted_connections if soft == resource.RLIM_INFINITY else max(16, min(wanted_connections,
                                                                                  soft - OWN_DESCRIPTORS))
    if allowed < wanted_connections:
        log.warning("endpoint: the open-file limit (%d, hard %d) leaves room for %d connections, not "
                    "sampler.openai.max_connections=%d (raise the hard limit: ulimit -Hn)", soft, hard, allowed,
                    wanted_connections)
    return allowed
