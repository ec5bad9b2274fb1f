"""Installing published weights on this sampler's mesh, whatever the transport.

A weight source (common/weights: grpc_transport, checkpoint_transport, local_transport, chosen by weights.transport
in common/registry/transports.py) finds the newest version and brings it onto this sampler's devices with its own
sharding. WeightSync owns the rules: a version is installed whole or not at all (with
`background`, fetched on a thread while generation goes on and handed over only
when complete, so the caller installs it when sampler.weight_updates says), a new
trainer epoch (restarted trainer) is followed even when its numbers are lower,
failed fetches back off exponentially (the sampler keeps its version), a final
version read from a store is final only for the trainer that published it (an
earlier trainer's, left in weights.checkpoint_dir, does not end a resumed run), and
`too_stale` says when generating would only make groups the trainer drops.

Only failures a later poll may not meet are retried (`retryable`): the trainer away or restarting, a deadline
passed, a version replaced while it was fetched. Anything else (a version whose shapes are not this sampler's
model, a token the trainer refuses, a transport the trainer does not serve) is raised from `poll`, at the first
attempt, and stops the sampler: retrying would only warn for ever.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import grpc
import jax
import numpy as np

from grpo_stream.common.runtime.console import detail_logger
from grpo_stream.common.model.lora import merge_named
from grpo_stream.common.model.policy import PolicyModel
from grpo_stream.common.model.sharding import param_shardings
from grpo_stream.common.registry.transports import TRANSPORTS
from grpo_stream.common.runtime.backoff import Backoff
from grpo_stream.common.runtime.errors import PermanentError, is_transient
from grpo_stream.common.weights.snapshot import WeightTransferError
from grpo_stream.common.weights.transport import check_names
from grpo_stream.protos import weights_pb2, weights_pb2_grpc

log = logging.getLogger(__name__)
detail = detail_logger(__name__)
QUICK_WAIT_S = 0.5  # how long poll() waits for a background check or fetch before generation goes on


def retryable(exc: BaseException) -> bool:
    """Whether a weight check or fetch that raised `exc` may succeed at a later poll: what is_transient says, and
    also a WeightTransferError (a version replaced while it was installed, a slice cut short or failing its
    checksum) and NOT_FOUND from the trainer (it published a newer version while this one was fetched: ask for the
    manifest again). A PermanentError never is."""
    if isinstance(exc, PermanentError):
        return False
    if isinstance(exc, WeightTransferError):
        return True
    if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.NOT_FOUND:
        return True
    return is_transient(exc)


@dataclasses.dataclass
class Installed:
    version: int
    params: Any
    final: bool
    fetch_seconds: float
    nbytes: int
    epoch: str = ""
    published_unix: float = 0.0  # when the trainer published it (the manifest's clock): publish -> installed time


class WeightSync:
    """Polls a fetcher and installs newer versions whole; reports the installed version to the trainer. `clock`
    (time.monotonic by default) times the back-off after a failed fetch; a test moves it instead of waiting.
    `fit_hint`: what the error says to do when a published version does not fit `model` (which setting to give the
    sampler). `overdue_after_s`: a background check or fetch still running after this long (a hung shared disk
    under the checkpoint transport, which has no deadline of its own) counts as a failure, once, and is reported,
    so the trainer's status shows it; it is still waited for (a slow restore of a large model is not a hung one,
    and a second attempt beside it would hold a second copy of the weights). None: never counted."""

    def __init__(self, fetcher, model: PolicyModel, mesh: jax.sharding.Mesh, sampler_id: str,
                 retry_initial_s: float = 0.5, retry_max_s: float = 10.0, max_staleness: int | None = None,
                 channel: grpc.Channel | None = None, background: bool = False,
                 clock: Callable[[], float] = time.monotonic, fit_hint: str = "",
                 overdue_after_s: float | None = None, process: str = ""):
        self.fetcher, self.model, self.sampler_id, self.clock = fetcher, model, sampler_id, clock
        self.process = process  # this sampler process's random id, sent with its reports (groups_generated's)
        self.overdue_after_s = overdue_after_s
        self.fit_hint = fit_hint
        self.max_staleness = max_staleness
        self._backoff = Backoff(retry_initial_s, retry_max_s)
        shardings = param_shardings(model.params, mesh)
        self.targets = {name: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s) for name, leaf, s in zip(
            model.names(), jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(shardings))}
        self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._base: tuple[str, dict, Any] | None = None  # LoRA: (trainer epoch, its frozen base, the jitted merge)
        self._report_stub = None if channel is None else weights_pb2_grpc.WeightServiceStub(channel)
        self.throughput = (0.0, 0.0)  # (groups/s, tokens/s) the sampler reports with its version
        self.groups_generated = 0  # reported too: the trainer's summary counts the run's wasted generation
        # the version in use here, params included (the sampler's weights in use ask it: weights_in_use.py); one
        # assignment, so other threads read it whole
        self.installed: Installed | None = None
        # the newest version fetched whole (installed, or handed over and waiting for the engine): never fetched again
        self.fetched_version, self.fetched_epoch = -1, ""
        self.latest_seen = -1  # newest version seen from the installed version's trainer epoch
        # latest_seen is raised by the fetch thread, the feeder's reports and the engine's installs: a read-max-write
        # not under this lock could write back, after an install of a restarted trainer's (lower) version reset it,
        # the old epoch's number, and the sampler then held generation as too stale until the new trainer caught up
        self._seen_lock = threading.Lock()
        self.failures, self._next_attempt = 0, 0.0
        self.background = background
        self._pending: concurrent.futures.Future | None = None
        self._pending_since, self._overdue_counted = 0.0, False
        # whether a newer version's bytes may come now (any thread): the sampler says no while a fetched version waits
        # for its engine, which would otherwise hold a third copy of the weights beside the installed and the waiting
        # one (a drain's groups outlast a publication). The newest version is still checked for (lag, final mark)
        self.may_fetch: Callable[[], bool] = lambda: True

    @property
    def installed_version(self) -> int:
        return self.installed.version if self.installed is not None else -1

    @property
    def installed_epoch(self) -> str:
        return self.installed.epoch if self.installed is not None else ""

    def lag(self) -> int:
        return max(0, self.latest_seen - self.installed_version) if self.installed_version >= 0 else 0

    def too_stale(self) -> bool:
        """True when groups made now would exceed the trainer's staleness bound (they would only be dropped)."""
        return self.max_staleness is not None and self.installed_version >= 0 and self.lag() > self.max_staleness

    def poll(self) -> Installed | None:
        """A newer version fetched whole, or None (nothing newer, still fetching in the background, backing off,
        or the fetch failed in a way a later poll may not: the sampler keeps its version and retries after a
        back-off). Raises what cannot be retried (`retryable`), e.g. WeightsMismatch."""
        if self._pending is None:
            if self.clock() < self._next_attempt:
                return None
            if not self.background:
                return self._settle(self._check_and_fetch)
            self._pending, self._pending_since = self._start_attempt(), self.clock()
            # most checks (and small fetches) finish within milliseconds: take their outcome now rather than a
            # poll interval later; anything slower carries on in the background
            concurrent.futures.wait([self._pending], timeout=QUICK_WAIT_S)
        if not self._pending.done():
            overdue = self.overdue_after_s is not None and self.clock() - self._pending_since > self.overdue_after_s
            if overdue and not self._overdue_counted:
                self._overdue_counted = True  # once per attempt: the lag and the failures show it
                self.failures += 1
                log.warning("%s: a weight check or fetch has run for %.0f s (sampler.rpc_timeout_s x 2 + 10 s) and "
                            "goes on; is the trainer or the weights' storage hung? (version %d in use, lag %d)",
                            self.sampler_id, self.clock() - self._pending_since, self.installed_version, self.lag())
                self.report()
            return None
        pending, self._pending, self._overdue_counted = self._pending, None, False
        return self._settle(pending.result)

    def _start_attempt(self) -> concurrent.futures.Future:
        """A check (and fetch) on a daemon thread of its own: one blocked in storage for ever does not keep the
        process from exiting, as a pool's worker would."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def attempt() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self._check_and_fetch())
            except BaseException as exc:  # noqa: BLE001 - handed to poll(), which classifies it
                future.set_exception(exc)

        threading.Thread(target=attempt, name="weight-fetch", daemon=True).start()
        return future

    def has_result(self) -> bool:
        """A background check or fetch has finished: the next poll() returns its outcome."""
        return self._pending is not None and self._pending.done()

    def _settle(self, attempt) -> Installed | None:
        try:
            got = attempt()
        except Exception as exc:  # noqa: BLE001 - classified: only what a later poll may not meet is retried
            if not retryable(exc):
                raise
            self.failures += 1
            delay = self._backoff.next()
            self._next_attempt = self.clock() + delay
            detail = (f"{exc.code()}: {exc.details()}" if isinstance(exc, grpc.RpcError)
                      else f"{type(exc).__name__}: {exc}")
            log.warning("%s weight fetch failed (%s); keeping version %d (lag %d), retry %d in %.1fs",
                        self.sampler_id, detail, self.installed_version, self.lag(), self.failures, delay)
            self.report()
            return None
        if got is not None and got.params is not None:
            self.failures = 0
            self._backoff.reset()
            self.fetched_version, self.fetched_epoch = got.version, got.epoch
        return got

    def _check_and_fetch(self) -> Installed | None:
        manifest = self.fetcher.latest(self.fetched_version)
        if manifest is None:
            return None
        if manifest.final and not self._final_of_live_trainer(manifest):
            manifest = _not_final(manifest)
        new_epoch = manifest.trainer_epoch != self.fetched_epoch
        if not new_epoch:
            self._saw(manifest.version)
        if not new_epoch and (manifest.version < self.fetched_version or (
                manifest.version == self.fetched_version and not manifest.final)):
            return None
        if not new_epoch and manifest.version == self.fetched_version:
            return Installed(manifest.version, None, True, 0.0, 0, manifest.trainer_epoch)
        # before any byte moves: a version of another model stops the sampler, however it is transported
        check_names(manifest.adapters.base if manifest.HasField("adapters") else manifest, self.targets,
                    self.fit_hint, manifest.version)
        if not self.may_fetch():
            return None  # asked again at the next poll
        detail.info("%s fetching weight version %d (%.1f MB, %s)", self.sampler_id, manifest.version,
                    manifest.total_bytes / 1e6, manifest.transport)
        start = time.monotonic()
        if self._base is not None and self._base[0] != manifest.trainer_epoch:
            # a LoRA trainer's base (a whole model on the devices) is never merged into by another epoch: let it go
            # before this version's bytes arrive, or a trainer restarted without model.lora leaves it held for good
            self._base = None
        if manifest.HasField("adapters"):
            named, nbytes = self._merged(manifest)
        else:
            named, nbytes = self.fetcher.fetch(manifest, self.targets), manifest.total_bytes
        params = self.model.params_from_arrays(named)
        jax.block_until_ready(params)
        return Installed(manifest.version, params, manifest.final, time.monotonic() - start, nbytes,
                         manifest.trainer_epoch, manifest.published_unix)

    def _final_of_live_trainer(self, manifest: weights_pb2.WeightManifest) -> bool:
        """Whether a final version is the end of the run. One read from a store (weights.checkpoint_dir) may be an
        earlier trainer process's: a finished run resumed to train further (docs/operations.md) left its last
        version there marked final, and its trainer serves its health check before it restores and publishes, so
        the sampler read that record first, installed it as final and stopped for good. A trainer that answers with
        nothing published yet (NOT_FOUND), or with another epoch, runs on; one that cannot be asked (it ended and
        exited) leaves the record as stored."""
        spec = TRANSPORTS.get(manifest.transport)
        if spec is None or not spec.needs_dir or self._report_stub is None:
            return True  # the manifest is the trainer's own (GetManifest, the in-process hub)
        try:
            live = self._report_stub.GetManifest(weights_pb2.GetManifestRequest(
                sampler_id=self.sampler_id, installed_version=self.fetched_version), timeout=5)
        except grpc.RpcError as exc:
            return exc.code() != grpc.StatusCode.NOT_FOUND
        return live.trainer_epoch == manifest.trainer_epoch

    def _merged(self, manifest: weights_pb2.WeightManifest) -> tuple[dict[str, Any], int]:
        """LoRA: the version's adapters (replicated: they are small) merged into the frozen base of its trainer
        epoch, which is fetched whole once per epoch and kept on the devices beside the merged weights; (weights,
        bytes fetched)."""
        lora, nbytes = manifest.adapters, manifest.total_bytes
        if self._base is None or self._base[0] != manifest.trainer_epoch:
            self._base = None  # another epoch's base: never merged into again
            detail.info("%s fetching the frozen base of trainer epoch %s (%.1f MB)", self.sampler_id,
                        manifest.trainer_epoch, lora.base.total_bytes / 1e6)
            base = self.fetcher.fetch(lora.base, self.targets)
            merges, scale = tuple(lora.merges), lora.scale
            merge = jax.jit(lambda b, a: merge_named(b, a, merges, scale),
                            out_shardings={name: t.sharding for name, t in self.targets.items()})
            self._base, nbytes = (manifest.trainer_epoch, base, merge), nbytes + lora.base.total_bytes
        targets = {t.name: jax.ShapeDtypeStruct(tuple(t.shape), np.dtype(t.dtype), sharding=self._replicated)
                   for t in manifest.tensors}
        _, base, merge = self._base
        return merge(base, self.fetcher.fetch(manifest, targets)), nbytes

    def close(self) -> None:
        """Stop background fetching and the fetcher's threads, without waiting (a fetch in flight ends at its
        deadline; its result is dropped)."""
        if self._pending is not None:
            self._pending.cancel()  # one not started yet never starts; a running one ends on its own thread
        close = getattr(self.fetcher, "close", None)
        if callable(close):
            close()

    def mark_installed(self, got: Installed, report: bool = True) -> None:
        """`got` is in use now; `report`: tell the trainer at once (else the caller reports later, off the engine's
        thread)."""
        with self._seen_lock:
            if got.epoch != self.installed_epoch:
                self.latest_seen = got.version
            self.installed = got
            self.latest_seen = max(self.latest_seen, got.version)
        if report:
            self.report()

    def report(self) -> None:
        """Tell the trainer which version runs here and how fetching goes (best effort, short deadline)."""
        if self._report_stub is None:
            return
        try:
            reply = self._report_stub.ReportVersion(weights_pb2.VersionReport(
                sampler_id=self.sampler_id, installed_version=self.installed_version, fetch_failures=self.failures,
                trainer_epoch=self.installed_epoch, groups_per_s=self.throughput[0], tokens_per_s=self.throughput[1],
                groups_generated=self.groups_generated, process=self.process),
                timeout=2)
            if reply.latest_version >= 0:
                self._saw(reply.latest_version)
        except grpc.RpcError:
            pass

    def _saw(self, version: int) -> None:
        with self._seen_lock:
            self.latest_seen = max(self.latest_seen, version)


def _not_final(manifest: weights_pb2.WeightManifest) -> weights_pb2.WeightManifest:
    """A copy of `manifest` without its final mark (the source's own object stays as it is)."""
    copy = weights_pb2.WeightManifest()
    copy.CopyFrom(manifest)
    copy.final = False
    return copy
