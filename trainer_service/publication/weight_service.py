"""The WeightService samplers call, for every transport: the latest manifest (GetManifest), their installed versions
and throughput (ReportVersion, into the publisher's sampler registry) and, for the grpc transport, the slices of a held
version (FetchSlices, served by grpc_transport_server/slices.py)."""

from __future__ import annotations

import time
from typing import Iterator

import grpc

from grpo_stream.common.rpc.auth import MAX_REPLICA, TokenTable, caller_of, may_act_as
from grpo_stream.common.rpc.call_guard import Watchdog
from grpo_stream.protos import weights_pb2, weights_pb2_grpc
from grpo_stream.trainer_service.publication.grpc_transport_server.data_plane import STALL_TIMEOUT_S
from grpo_stream.trainer_service.publication.grpc_transport_server.slices import FetchRefused, SliceServer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.publication.samplers import MAX_SAMPLER_ID_CHARS


class WeightService(weights_pb2_grpc.WeightServiceServicer):
    """`publisher`'s versions and sampler registry over gRPC. `slices`: how a fetch is served (None: a SliceServer of
    `publisher` without a rate cap); `table`: the tokens that may speak for each sampler id (None: no auth).

    A fetch streams from the snapshot of its version, which it holds until it ends: a peer that stops reading (a
    hostile or broken client, one without a deadline) would hold that host copy of the model, and a server thread,
    for ever, one more copy per version it stalled on. So a chunk the peer does not take within `stall_timeout_s`,
    or a fetch still streaming after `transfer_timeout_s` (default: the most a sampler's rpc_timeout_s allows, so a
    sampler's own deadline ends it first), cancels the call, as the TCP data plane ends its transfers."""

    def __init__(self, publisher: WeightPublisher, slices: SliceServer | None = None, table: TokenTable | None = None,
                 stall_timeout_s: float = STALL_TIMEOUT_S, transfer_timeout_s: float = 3600.0):
        self.publisher, self.table = publisher, table
        self.slices = SliceServer(publisher) if slices is None else slices
        self.stall_timeout_s, self.transfer_timeout_s = stall_timeout_s, transfer_timeout_s
        self._watchdog = Watchdog()  # one thread for every fetch's timer, started on demand

    def GetManifest(self, request, context):
        self._check_caller(context, request.sampler_id)
        manifest = self.publisher.manifest
        # seen, nothing more: the request names the newest version the caller fetched, which may still wait for its
        # engine (`drain`), and no epoch; what runs there, and how its fetches go, come from its ReportVersion
        if manifest is not None:
            self.publisher.samplers.record(request.sampler_id, -1)
        if manifest is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "no weights published yet; retry shortly")
        return manifest

    def ReportVersion(self, request, context):
        self._check_caller(context, request.sampler_id)
        if not request.trainer_epoch or request.trainer_epoch == self.publisher.epoch:  # another epoch's: not ours
            self.publisher.samplers.record(request.sampler_id, request.installed_version, request.fetch_failures,
                                           (request.groups_per_s, request.tokens_per_s), request.groups_generated,
                                           request.process[:64])
        latest = self.publisher.latest_version
        return weights_pb2.VersionReportReply(latest_version=-1 if latest is None else latest)

    def FetchSlices(self, request, context):
        try:
            plan = self.slices.plan(request)
        except FetchRefused as exc:
            context.abort(exc.code, exc.message)
        yield from self._bounded(self.slices.chunks(plan), context)

    def _bounded(self, chunks: Iterator[weights_pb2.SliceChunk], context) -> Iterator[weights_pb2.SliceChunk]:
        """`chunks`, the call cancelled when one is not sent within the stall timeout or the transfer's time is up.
        grpcio asks for the next chunk only once the last one was sent, so the stall counts while a chunk waits for
        the peer, never while the pacing (weights.max_serve_mb_s) waits."""
        guard = _StallGuard(self._watchdog, context, self.stall_timeout_s, self.transfer_timeout_s)
        try:
            for chunk in chunks:
                if guard.expired():
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"weight fetch still streaming after "
                                  f"{self.transfer_timeout_s:.0f}s; fetch again")
                guard.sending = time.monotonic()
                yield chunk
                guard.sending = None
        finally:
            guard.finish()

    def _check_caller(self, context, sampler_id: str) -> None:
        """PERMISSION_DENIED unless the caller's token may speak for `sampler_id`: otherwise one sampler could
        report versions, throughput and generated groups for another and skew its lag and the run's waste. An id
        longer than MAX_SAMPLER_ID_CHARS is INVALID_ARGUMENT, with auth or without: the registry keeps each id it
        hears whole, and ids of messages' size (64 MiB) would make its 1024 entries gigabytes."""
        if len(sampler_id) > MAX_SAMPLER_ID_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampler_id: {len(sampler_id)} characters, more than "
                          f"{MAX_SAMPLER_ID_CHARS}; name samplers sampler-<k> (or after their token)")
        if self.table is None or not sampler_id:
            return
        caller = caller_of(context, self.table)
        if not may_act_as(caller, sampler_id):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"sampler_id: {sampler_id[:64]!r} is not this token's "
                          f"({caller.name!r} may report as {caller.name!r} or '{caller.name}-<k>', k in "
                          f"0..{MAX_REPLICA}); give each sampler its own token or fix sampler ids")


class _StallGuard:
    """One fetch's timer: one watchdog entry at a time, re-armed at most once per stall timeout (not once per chunk:
    a disarmed entry stays in the watchdog's heap until its time)."""

    def __init__(self, watchdog: Watchdog, context, stall_s: float, transfer_s: float):
        self.watchdog, self.context, self.stall_s = watchdog, context, stall_s
        self.deadline = time.monotonic() + transfer_s
        self.sending: float | None = None  # when the chunk being sent was handed to grpcio (None: none is)
        self._done = False
        self._entry = watchdog.arm(min(stall_s, transfer_s), self._check)

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def finish(self) -> None:
        self._done = True
        self.watchdog.disarm(self._entry)

    def _check(self) -> None:
        if self._done:
            return
        now, since = time.monotonic(), self.sending
        if now >= self.deadline or (since is not None and now - since >= self.stall_s):
            self.context.cancel()  # a send blocked on a peer that does not read returns; the stream ends
            return
        wait = self.stall_s - (now - since) if since is not None else self.stall_s
        self._entry = self.watchdog.arm(max(0.01, min(wait, self.deadline - now)), self._check)
