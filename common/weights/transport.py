"""The weight-transport link: how a published version gets from the trainer to the samplers.

A transport is a pair. The trainer's `WeightSink` makes a version available (`put`) and describes it with a
manifest; a sampler's `WeightSource` finds the newest manifest (`latest`) and brings that version onto its own
devices with its own sharding (`fetch`). Around the pair the rules stay the same for every transport: the trainer's
WeightPublisher (trainer_service/publication/publisher.py) numbers versions, and its WeightService serves manifests
and hears which version each sampler installed; a sampler's WeightSync (sampler_service/weight_sync.py) installs a version whole or not at all,
follows a restarted trainer's epoch and backs off after failures.

A transport is one module with `make_sink(ctx)` and `make_source(ctx)` and one line in
common/registry/transports.py. A source's failures say whether polling again can help (common/runtime/errors.py): a
version that does not fit the sampler's model raises WeightsMismatch, a PermanentError that stops the sampler; a
version replaced or cut short while it was fetched raises WeightTransferError or a TransientError, and the sampler
fetches again after a back-off.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.protos import weights_pb2


class WeightSink(Protocol):
    """Trainer side."""

    def put(self, version: int, named: dict[str, Any], final: bool, epoch: str, now: float, *,
            adapters: weights_pb2.AdapterVersion | None = None) -> tuple[weights_pb2.WeightManifest, Any]:
        """Make `named` (device or host arrays) available as `version`; return its manifest and, for a transport
        whose bytes the trainer serves, the host snapshot to serve them from (else None). `adapters` (LoRA: `named`
        holds adapters only) goes into the manifest, and into whatever samplers read manifests from."""


class WeightSource(Protocol):
    """Sampler side."""

    def latest(self, installed_version: int) -> weights_pb2.WeightManifest | None:
        """The newest published version's manifest, or None when nothing is published yet."""

    def fetch(self, manifest: weights_pb2.WeightManifest, targets: dict[str, Any]) -> dict[str, Any]:
        """That version's arrays, each placed with its target's (jax.ShapeDtypeStruct) sharding and dtype."""


@dataclasses.dataclass(frozen=True)
class SinkContext:
    weights: Any               # the config's weights section
    hub: Any = None            # the in-process hub (in_process transports)


@dataclasses.dataclass(frozen=True)
class SourceContext:
    weights: Any               # the config's weights section
    sampler_id: str
    rpc_timeout_s: float
    channel: Any = None        # gRPC channel to the trainer (its WeightService)
    trainer_host: str = ""     # for a data plane the trainer serves on another port
    security: Any = None       # ClientSecurity: token and TLS for that data plane
    hub: Any = None            # the in-process hub (in_process transports)


DEFAULT_FIT_HINT = "start the sampler with the trainer's model settings (model.kind, model.path, model.tiny)"


class WeightsMismatch(PermanentError):
    """A published version whose tensors are not this sampler's model's (names or shapes): trainer and sampler were
    started with different models, and no retry changes that."""


def mismatch(manifest: weights_pb2.WeightManifest, targets: dict[str, Any]) -> str | None:
    """How the published tensors differ from the sampler model's (`targets`: name -> anything with .shape), naming
    a parameter and both shapes; None when names and shapes are the same (dtypes may differ: the sampler casts)."""
    specs = {t.name: tuple(t.shape) for t in manifest.tensors}
    missing, extra = sorted(set(targets) - set(specs)), sorted(set(specs) - set(targets))
    if missing or extra:
        return (f"{len(missing)} of its parameters are not published (e.g. {missing[:3]}) and {len(extra)} published "
                f"ones are not in it (e.g. {extra[:3]})")
    wrong = [(name, specs[name], tuple(t.shape)) for name, t in targets.items() if specs[name] != tuple(t.shape)]
    if not wrong:
        return None
    name, there, here = wrong[0]
    more = f" ({len(wrong) - 1} more parameters differ)" if len(wrong) > 1 else ""
    return f"{name} is {there} there and {here} here{more}"


def check_names(manifest: weights_pb2.WeightManifest, targets: dict[str, Any], hint: str = "",
                version: int | None = None) -> None:
    """The published tensors must be exactly the sampler model's, with the same shapes; WeightsMismatch (permanent)
    naming both shapes and `hint` (how to start the sampler instead) when not. `version`: the version to name
    (default the manifest's; LoRA checks the base manifest of an adapters version)."""
    why = mismatch(manifest, targets)
    if why is not None:
        version = manifest.version if version is None else version
        raise WeightsMismatch(f"weights version {version} from the trainer do not fit this sampler's model: {why}; "
                              f"{hint or DEFAULT_FIT_HINT}")
