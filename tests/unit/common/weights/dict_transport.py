"""A weight transport made only for tests/unit/common/test_registries.py: host copies in a dictionary of this
process. It shows what adding a transport takes: this module and one registry line."""

from __future__ import annotations

import jax
import numpy as np

from grpo_stream.common.weights.snapshot import manifest_of
from grpo_stream.common.weights.transport import check_names

SHELF: dict[str, tuple] = {}  # "latest" -> (manifest, host arrays)


class DictSink:
    def put(self, version, named, final, epoch, now):
        host = {n: np.asarray(a) for n, a in named.items()}
        manifest = manifest_of(version, {n: (a.shape, a.dtype) for n, a in host.items()}, final, epoch, now, 0, "dict")
        SHELF["latest"] = (manifest, host)
        return manifest, None


class DictSource:
    def latest(self, installed_version):
        return SHELF["latest"][0] if SHELF else None

    def fetch(self, manifest, targets):
        check_names(manifest, targets)
        host = SHELF["latest"][1]
        return {n: jax.device_put(host[n].astype(t.dtype), t.sharding) for n, t in targets.items()}


def make_sink(ctx):
    return DictSink()


def make_source(ctx):
    return DictSource()
