"""Which weights a sampler generates with: its first version, newer ones as they arrive, and when they take over.

`WeightsInUse` is the sampler loop's (loop.py) keeper of them. The feeder's thread polls the weight sync (`poll`):
before the rollout stream runs (the first version) a fetched version is installed at once; while it runs, it is
staged, and the engine installs it at its next scheduling point (`StagedWeights.refresh`, on its thread): at once with
sampler.weight_updates=in_flight (every live sequence continues with it, each token recording its version), or,
with drain, once no group of the old version is in flight (the feeder starts none meanwhile, and endpoint requests
from outside wait). The final version is installed by the feeder after the stream is cancelled: nothing generated
after it could be trained. Every wait here ends at once on a stop request, and raises what stopped the rollout
sender and what a weight check cannot retry (WeightSync.poll): a sampler never waits for weights while nothing can
send what it would make, nor retries weights of another model.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

import grpc

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.runtime.console import detail_logger
from grpo_stream.sampler_service.connect import trainer_serving

log = logging.getLogger(__name__)
detail = detail_logger(__name__)
LOG_WAIT_EVERY_S = 30.0  # how often a wait for the trainer's first weights is logged


class StagedWeights:
    """A fetched version waiting for the engine, and when it may take over (sampler.weight_updates: 'in_flight', at
    the engine's next scheduling point; 'drain', once `drained()` says no group of the installed version is in
    flight). A version of another trainer epoch than the installed one's (`installed_epoch()`: a restarted trainer,
    whose numbers may be lower) is always drained for, whatever the mode: a sequence continued with it would record
    versions of two trainers ([50, 40]: refused by the ingest, whose version runs must not decrease). `install(got)`
    makes a version the one in use; `stream` (a RolloutStream, set while it runs) is told to stop taking outside work
    while a drain waits. With 'drain', a version of the installed one's epoch also waits, without holding the
    feeder, until the installed version had its turn (`had_turn()`: a group started with it, or the feeder found it
    could start none): versions arriving faster than a loaded sampler installs them otherwise kept it draining for
    each and starting nothing (79 installs and 2 groups in 57 s). Thread-safe: the feeder stages, the engine takes."""

    def __init__(self, mode: str, install: Callable, drained: Callable[[], bool],
                 installed_epoch: Callable[[], str] = lambda: "", had_turn: Callable[[], bool] = lambda: True):
        self.mode, self.install, self.drained, self.installed_epoch = mode, install, drained, installed_epoch
        self.had_turn = had_turn
        self.stream = None
        self._got = None
        self._lock = threading.Lock()

    def stage(self, got) -> None:
        """A newer fetched version (none is fetched while one waits here: `holding`)."""
        with self._lock:
            self._got = got

    def mark_final(self, version: int) -> bool:
        """The staged version, if it is `version`, marked final (the trainer's last); whether it was."""
        with self._lock:
            if self._got is None or self._got.version != version:
                return False
            self._got = dataclasses.replace(self._got, final=True)
            return True

    def holding(self) -> bool:
        """A fetched version waits here, not installed yet."""
        with self._lock:
            return self._got is not None

    def final(self):
        """The final version, staged and not installed (or None): the feeder installs it after the stream ends."""
        with self._lock:
            return self._got if self._got is not None and self._got.final else None

    def waiting(self) -> bool:
        """A drain waits for the groups in flight: no group may start."""
        with self._lock:
            return self._got is not None and self._drains_for(self._got) and not self._deferred(self._got)

    def _drains_for(self, got) -> bool:
        """Whether `got` waits for the groups in flight to end (the lock held)."""
        return self.mode == "drain" or getattr(got, "epoch", "") != self.installed_epoch()

    def _deferred(self, got) -> bool:
        """Whether `got` waits for the installed version's turn before its drain begins (the lock held). Never for
        another trainer epoch's version: the installed one's groups could not be sent (the rollout client drops them)."""
        return self.mode == "drain" and getattr(got, "epoch", "") == self.installed_epoch() and not self.had_turn()

    def refresh(self):
        """The engine's scheduling points (its thread): the staged version as (params, version) when it may take
        over now, else None. A final version is left to the feeder."""
        with self._lock:
            got = self._got
            if got is None or got.final or self._deferred(got):
                return None
            if self._drains_for(got) and not self.drained():
                if self.stream is not None:
                    self.stream.set_accepting(False)
                return None
            self._got = None
            # under the lock: a feeder told nothing waits (`waiting`) must already read the new version and epoch,
            # or it starts a group labelled with the old ones that the engine draws with the new weights
            self.install(got)
        if self.stream is not None:
            self.stream.set_accepting(True)
        return got.params, got.version


class WeightsInUse:
    """The installed version, the one staged to follow it, and the first wait. The installed version is the weight
    sync's (`WeightSync.installed`, the one place that holds it); `params`, `version` and `installed()` ask it.
    `attach` gives the sync, the rollout client and the metrics once the sampler is set up; `stream_started` the
    RolloutStream and the endpoint's queue while the stream runs."""

    def __init__(self, cfg: RunConfig, sampler_id: str, stop_event: threading.Event):
        self.cfg, self.sampler_id, self.stop_event = cfg, sampler_id, stop_event
        self.final, self.last_poll = False, float("-inf")  # the first check is due at once
        self.groups_at_version = 0  # groups started with the installed version (counted by the feeder, reset by the
        self._count_lock = threading.Lock()  # engine's install: a lost update would keep the old version's count)
        self._feeder_passed = False  # the feeder found it could start no group with the installed version (drain)
        self.installed_versions: list[int] = []
        self.fetch_seconds: list[float] = []
        self.fetch_bytes: list[int] = []  # per installed version (with LoRA: the adapters, and the base when fetched)
        self.publish_to_install_s: list[float] = []  # per installed version: trainer's publication -> installed here
        self.sync = self.client = self.metrics = self.stream = self.engine_side = None
        # a fetched version the engine has not taken yet (while the stream runs)
        self.staged = StagedWeights(cfg.sampler.weight_updates, self._install, self._drained,
                                    lambda: self.sync.installed_epoch, self._had_turn)
        self._reported: tuple[int, str] = (-1, "")  # (version, trainer epoch) last reported to the trainer

    def attach(self, sync, client, metrics) -> None:
        """The sampler's weight sync (WeightSync), rollout client (RolloutClient) and metrics
        (lifecycle.SamplerMetrics)."""
        self.sync, self.client, self.metrics = sync, client, metrics
        # one version arriving or waiting for the engine at a time, beside the one in use (`grpo-stream plan`'s
        # fetch_buffer): a newer one is fetched once the engine took the staged one
        if sync is not None:
            sync.may_fetch = lambda: not self.staged.holding()

    def stream_started(self, stream, engine_side) -> None:
        """The rollout stream runs (None: it ended): fetched versions are staged for its engine, and a drain waits
        for its groups and for the endpoint's requests inside the engine (`engine_side`, a SideQueue or None)."""
        self.stream = self.staged.stream = stream
        self.engine_side = engine_side

    def installed(self) -> tuple:
        """The installed (params, version), read whole (any thread); (None, -1) before the first version."""
        got = self.sync.installed if self.sync is not None else None
        return (None, -1) if got is None else (got.params, got.version)

    @property
    def params(self):
        return self.installed()[0]

    @property
    def version(self) -> int:
        return self.installed()[1]

    @property
    def epoch(self) -> str:
        """The installed version's trainer epoch ("" before the first version, or from a transport without one)."""
        return self.sync.installed_epoch if self.sync is not None else ""

    def group_started(self) -> None:
        with self._count_lock:
            self.groups_at_version += 1

    def feeder_passed(self) -> None:
        """The feeder could start no group with the installed version (admission granted none, the backlog is full,
        the weights are too stale or capped): a version staged meanwhile need not wait for one (StagedWeights)."""
        with self._count_lock:
            self._feeder_passed = True

    def _had_turn(self) -> bool:
        with self._count_lock:
            return self.groups_at_version > 0 or self._feeder_passed

    def await_first(self, stub, beat: Callable[[], None] = lambda: None) -> None:
        """Install the trainer's first version before generating. A trainer that is up but has not published yet
        (warm start, eval_before, loading a large checkpoint: minutes to hours) is waited for as long as it
        answers, and each answer calls `beat` (the sampler's heartbeat: without it `up` took the wait for a hang
        and killed the sampler every up.sampler_stall_s); one silent for sampler.connect_timeout_s ends the sampler
        (ConnectionError)."""
        timeout = self.cfg.sampler.connect_timeout_s
        started = heard = last_log = last_check = time.monotonic()
        while self.params is None and not self.stop_event.is_set():
            # every sampler.weight_poll_s (or as a background fetch ends), not at every turn of this wait: a warm
            # start of hours made each sampler check (a GetManifest call, a thread) 20 times a second
            if self.poll_due():
                self.poll()
            if self.params is not None:
                return
            now = time.monotonic()
            if now - last_check >= 1.0:
                last_check = now
                try:
                    if trainer_serving(stub, self.cfg.trainer_address()):
                        heard = now
                        beat()
                except grpc.RpcError:  # not answering now (a refusal no retry changes raises PermanentError)
                    pass
                if now - heard > timeout:
                    raise ConnectionError(
                        f"sampler.trainer_address={self.cfg.trainer_address()}: the trainer stopped answering for "
                        f"{timeout:.0f}s (sampler.connect_timeout_s) before it published any weights")
            if now - last_log >= LOG_WAIT_EVERY_S:
                last_log = now
                log.info("%s waiting for the trainer's first weights (%.0fs so far; the trainer is up, e.g. in its "
                         "warm start or eval_before)", self.sampler_id, now - started)
            self.stop_event.wait(0.05 if self.cfg.weights.background_fetch else 0.5)

    def poll(self) -> None:
        """Check for a newer published version: installed at once while no stream runs, else staged for the engine
        (no newer one is fetched until the engine has taken it: `attach`)."""
        self.last_poll = time.monotonic()
        got = self.sync.poll()
        if self.metrics is not None:
            self.metrics.lag.set(self.sync.lag())
            self.metrics.failures.set(self.sync.failures)
        if got is None:
            return
        if got.params is None:  # the newest version fetched, now marked final
            if not (got.final and self.staged.mark_final(got.version)):
                self.final = self.final or got.final
            return
        if self.client is not None and got.epoch:  # from now on only groups of the newest trainer's weights are sent
            self.client.epoch = got.epoch
        if self.stream is None:
            self._install(got)
            self.final = got.final
            return
        self.staged.stage(got)

    def final_reached(self) -> bool:
        """The trainer's last version is here: staged for the feeder to install after the stream, or already in use
        (a version this sampler had, or its engine took in flight, that the trainer then marked final, as a resumed
        run that was already complete does)."""
        return self.final or self.staged.final() is not None

    def install_final(self) -> bool:
        """After the stream ended: install the final version if one is staged; whether one was."""
        final = self.staged.final()
        if final is None:
            return False
        self._install(final)
        self.final = True
        self.report_installed()
        return True

    def _install(self, got) -> None:
        """Make `got` the version in use (any thread: nothing here waits on the network)."""
        with self._count_lock:
            self.groups_at_version, self._feeder_passed = 0, False
        self.sync.mark_installed(got, report=False)  # reported by the feeder's thread (report_installed)
        if self.client is not None:  # queued groups the trainer would now drop as stale are not sent
            self.client.min_version = max(0, got.version - self.cfg.trainer.max_staleness)
        self.installed_versions.append(got.version)
        self.fetch_seconds.append(round(got.fetch_seconds, 4))
        self.fetch_bytes.append(got.nbytes)
        if got.published_unix:
            self.publish_to_install_s.append(round(time.time() - got.published_unix, 4))
        if self.metrics is not None:
            self.metrics.version.set(got.version)
        detail.info("%s installed weight version %d (%.1f MB, fetch %.2fs)%s", self.sampler_id, got.version,
                    got.nbytes / 1e6, got.fetch_seconds, " [final]" if got.final else "")

    def report_installed(self) -> None:
        """Tell the trainer about a version the engine installed since the last report (the feeder's thread)."""
        installed = (self.version, self.epoch)  # a restarted trainer's first version may repeat the old one's number
        if installed != self._reported:
            self._reported = installed
            self.sync.report()

    def _drained(self) -> bool:
        """No group of the installed version is in flight, nor an outside endpoint request inside the engine."""
        return self.stream.episodes_in_flight == 0 and (self.engine_side is None or self.engine_side.in_engine == 0)

    def poll_due(self) -> bool:
        """A weight check is due: the poll interval passed, or a background fetch finished."""
        return time.monotonic() - self.last_poll >= self.cfg.sampler.weight_poll_s or self.sync.has_result()
