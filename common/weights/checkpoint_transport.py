"""The `checkpoint` weight transport: Orbax saves to weights.checkpoint_dir (a shared disk or gs://) with a
completion marker; samplers find the newest complete version there and restore it straight into their sharding.
Works when samplers cannot reach the trainer's ports, and keeps the last weights.keep_versions versions."""

from __future__ import annotations

import base64

import numpy as np

from grpo_stream.common.weights.checkpoint_store import CheckpointWeightStore
from grpo_stream.common.weights.snapshot import manifest_of
from grpo_stream.common.weights.transport import SinkContext, SourceContext, check_names
from grpo_stream.protos import weights_pb2


def _store(weights) -> CheckpointWeightStore:
    if not weights.checkpoint_dir:
        raise ValueError("weights.transport=checkpoint needs weights.checkpoint_dir: a directory the trainer and every "
                         "sampler can reach (shared disk or gs://); `up` uses RUN_DIR/weights")
    return CheckpointWeightStore(weights.checkpoint_dir, weights.keep_versions)


class CheckpointSink:
    def __init__(self, store: CheckpointWeightStore):
        self.store = store

    def put(self, version, named, final, epoch, now, *, adapters=None):
        specs = {n: (tuple(a.shape), np.dtype(a.dtype)) for n, a in named.items()}
        extra = None if adapters is None else {"adapters": base64.b64encode(adapters.SerializeToString()).decode()}
        record = self.store.save(version, named, final, epoch, extra)
        return _with_adapters(manifest_of(version, specs, final, epoch, now, 0, "checkpoint", record["location"]),
                              record), None


def _with_adapters(manifest: weights_pb2.WeightManifest, record: dict) -> weights_pb2.WeightManifest:
    """`manifest` with the LoRA merge its COMPLETE record carries (a proto message, base64)."""
    if record.get("adapters"):
        manifest.adapters.ParseFromString(base64.b64decode(record["adapters"]))
    return manifest


def make_sink(ctx: SinkContext) -> CheckpointSink:
    return CheckpointSink(_store(ctx.weights))


def make_source(ctx: SourceContext) -> "CheckpointFetcher":
    return CheckpointFetcher(_store(ctx.weights))


class CheckpointFetcher:
    def __init__(self, store: CheckpointWeightStore):
        self.store = store

    def latest(self, installed_version: int) -> weights_pb2.WeightManifest | None:
        record = self.store.latest()
        if record is None:
            return None
        specs = {n: (s, np.dtype(d)) for n, s, d in record["tensors"]}
        return _with_adapters(manifest_of(record["version"], specs, record["final"], record["epoch"],
                                          record["published_unix"], 0, "checkpoint", record["location"]), record)

    def fetch(self, manifest: weights_pb2.WeightManifest, targets: dict) -> dict:
        check_names(manifest, targets)
        record = {"location": manifest.location, "tensors": [[t.name, list(t.shape), t.dtype]
                                                             for t in manifest.tensors]}
        return self.store.restore(record, targets)
