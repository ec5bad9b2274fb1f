"""The WeightService samplers call, for every transport: the latest manifest (GetManifest), their installed versions
and throughput (ReportVersion, into the publisher's sampler registry) and, for the grpc transport, the slices of a held
version (FetchSlices, served by grpc_transport_server/slices.py)."""

from __future__ import annotations

import grpc

from grpo_stream.common.rpc.auth import MAX_REPLICA, TokenTable, caller_of, may_act_as
from grpo_stream.protos import weights_pb2, weights_pb2_grpc
from grpo_stream.trainer_service.publication.grpc_transport_server.slices import FetchRefused, SliceServer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher


class WeightService(weights_pb2_grpc.WeightServiceServicer):
    """`publisher`'s versions and sampler registry over gRPC. `slices`: how a fetch is served (None: a SliceServer of
    `publisher` without a rate cap); `table`: the tokens that may speak for each sampler id (None: no auth)."""

    def __init__(self, publisher: WeightPublisher, slices: SliceServer | None = None, table: TokenTable | None = None):
        self.publisher, self.table = publisher, table
        self.slices = SliceServer(publisher) if slices is None else slices

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
        yield from self.slices.chunks(plan)

    def _check_caller(self, context, sampler_id: str) -> None:
        """PERMISSION_DENIED unless the caller's token may speak for `sampler_id`: otherwise one sampler could
        report versions, throughput and generated groups for another and skew its lag and the run's waste."""
        if self.table is None or not sampler_id:
            return
        caller = caller_of(context, self.table)
        if not may_act_as(caller, sampler_id):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"sampler_id: {sampler_id[:64]!r} is not this token's "
                          f"({caller.name!r} may report as {caller.name!r} or '{caller.name}-<k>', k in "
                          f"0..{MAX_REPLICA}); give each sampler its own token or fix sampler ids")
