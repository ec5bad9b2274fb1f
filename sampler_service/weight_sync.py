"""Fetching published weights from the trainer and turning them into this sampler's params."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import grpc

from common.model import PolicyModel
from common.weights import WeightTransferError, assemble
from protos import weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Installed:
    version: int
    params: Any
    final: bool
    fetch_seconds: float
    nbytes: int


class WeightSync:
    """Polls the trainer's manifest and fetches newer versions whole (checked) or not at all."""

    def __init__(self, channel: grpc.Channel, sampler_id: str, model: PolicyModel, rpc_timeout_s: float):
        self._stub = weights_pb2_grpc.WeightServiceStub(channel)
        self.sampler_id, self.model, self.rpc_timeout_s = sampler_id, model, rpc_timeout_s
        self.installed_version = -1

    def latest_manifest(self) -> weights_pb2.WeightManifest | None:
        """The trainer's newest manifest, or None when nothing is published yet (reports our version)."""
        try:
            return self._stub.GetManifest(weights_pb2.GetManifestRequest(
                sampler_id=self.sampler_id, installed_version=self.installed_version), timeout=10)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def fetch(self, manifest: weights_pb2.WeightManifest) -> Installed:
        start = time.monotonic()
        chunks = self._stub.FetchWeights(weights_pb2.FetchWeightsRequest(
            sampler_id=self.sampler_id, version=manifest.version), timeout=self.rpc_timeout_s)
        arrays = assemble(manifest, chunks)
        params = self.model.from_named_numpy(arrays)
        return Installed(manifest.version, params, manifest.final, time.monotonic() - start, manifest.total_bytes)

    def poll(self) -> Installed | None:
        """A newer version if one is published and fetched whole; None otherwise. Never raises on transport errors."""
        try:
            manifest = self.latest_manifest()
            if manifest is None or manifest.version < self.installed_version or (
                    manifest.version == self.installed_version and not manifest.final):
                return None
            if manifest.version == self.installed_version and manifest.final:
                return Installed(manifest.version, None, True, 0.0, 0)
            return self.fetch(manifest)
        except grpc.RpcError as exc:
            log.warning("weight poll failed (%s: %s); keeping version %d", exc.code(), exc.details(),
                        self.installed_version)
        except WeightTransferError as exc:
            log.error("weight transfer corrupt (%s); keeping version %d", exc, self.installed_version)
        return None

    def mark_installed(self, version: int) -> None:
        self.installed_version = version

    def report(self) -> None:
        """Tell the trainer which version runs here (best effort)."""
        try:
            self.latest_manifest()
        except grpc.RpcError:
            pass
