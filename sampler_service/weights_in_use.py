"""Which weights a sampler generates with, and its waits for them: the first version, a version fresh enough for
the trainer's staleness bound, a newer version in synchronous mode, and weight checks while the backlog is full.

`WeightsInUse` is the sampler loop's base (loop.py): it holds the installed parameters and their history, and
installs what `WeightSync.poll` returns. Every wait here ends at once on a stop request, and raises what stopped the
rollout sender (RolloutClient.check) and what a weight check cannot retry (WeightSync.poll): a sampler never waits
for weights while nothing can send what it would make, nor retries weights of another model.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.runtime.console import detail_logger
from grpo_stream.sampler_service.connect import trainer_serving

log = logging.getLogger(__name__)
detail = detail_logger(__name__)
LOG_WAIT_EVERY_S = 30.0  # how often a wait for the trainer's first weights is logged


class WeightsInUse:
    """The installed version and its waits. `sync` (WeightSync), `client` (RolloutClient) and `metrics`
    (lifecycle.SamplerMetrics) are set once the sampler is set up."""

    def __init__(self, cfg: RunConfig, sampler_id: str, stop_event: threading.Event):
        self.cfg, self.sampler_id, self.stop_event = cfg, sampler_id, stop_event
        self.params, self.version, self.final, self.last_poll = None, -1, False, 0.0
        self.installed: tuple = (None, -1)  # (params, version), for threads other than the loop's
        self.groups_at_version = 0  # groups generated with the installed version
        self.installed_versions: list[int] = []
        self.fetch_seconds: list[float] = []
        self.fetch_bytes: list[int] = []  # per installed version (with LoRA: the adapters, and the base when fetched)
        self.publish_to_install_s: list[float] = []  # per installed version: trainer's publication -> installed here
        self.waited_for_weights_s = 0.0
        self.sync = self.client = self.metrics = None

    def _await_first_weights(self, stub) -> None:
        """Install the trainer's first version before generating. A trainer that is up but has not published yet
        (warm start, eval_before, loading a large checkpoint: minutes to hours) is waited for as long as it
        answers; one silent for sampler.connect_timeout_s ends the sampler (ConnectionError)."""
        timeout = self.cfg.sampler.connect_timeout_s
        started = heard = last_log = last_check = time.monotonic()
        while self.params is None and not self.stop_event.is_set():
            self._poll_weights()
            if self.params is not None:
                return
            now = time.monotonic()
            if now - last_check >= 1.0:
                last_check = now
                try:
                    if trainer_serving(stub, self.cfg.trainer_address()):
                        heard = now
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

    def _await_fresh_weights(self) -> None:
        """The installed version is more than trainer.max_staleness behind the newest: the trainer would drop what
        is generated now, so wait for newer weights (or the final version, or a stop)."""
        log.warning("%s: version %d is %d behind the newest (trainer.max_staleness %d); waiting for weights",
                    self.sampler_id, self.version, self.sync.lag(), self.cfg.trainer.max_staleness)
        while self.sync.too_stale() and not self.stop_event.is_set() and not self.final:
            self._check_sender()
            self.stop_event.wait(self.cfg.sampler.weight_poll_s)
            self._poll_weights()

    def _await_newer_version(self, started_wait: float) -> None:
        """Synchronous mode: poll until a newer (or final) version is installed, or a stop is asked for."""
        version = self.version
        while self.version == version and not self.final and not self.stop_event.is_set():
            self._check_sender()
            pause = self.cfg.sampler.weight_poll_s - (time.monotonic() - self.last_poll)
            if pause > 0:
                self.stop_event.wait(pause)
            self._poll_weights()
        self.waited_for_weights_s += time.monotonic() - started_wait

    def _push(self, client, group) -> bool:
        """Hand a group to the sender; while its backlog is full keep checking for new (or final) weights.
        False when the sampler must stop instead (signal or final version); raises what stopped the sender."""
        while not client.put(group, timeout_s=0.5):
            if self.stop_event.is_set():
                return False
            if time.monotonic() - self.last_poll >= self.cfg.sampler.weight_poll_s:
                self._poll_weights()
                if self.final:
                    return False
        return True

    def _check_sender(self) -> None:
        if self.client is not None:
            self.client.check()

    def _poll_weights(self) -> None:
        """Install a newer published version if there is one (only ever between generation batches, or at the
        engine's refresh points with weight_updates=in_flight)."""
        self.last_poll = time.monotonic()
        got = self.sync.poll()
        if self.metrics is not None:
            self.metrics.lag.set(self.sync.lag())
            self.metrics.failures.set(self.sync.failures)
        if got is None:
            return
        if got.params is not None:
            self._install(got)
        self.final = got.final

    def _install(self, got) -> None:
        self.params, self.version, self.groups_at_version = got.params, got.version, 0
        self.installed = (got.params, got.version)  # one assignment: other threads read the pair whole
        self.sync.mark_installed(got)
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

    def _poll_due(self) -> bool:
        """A weight check is due: the poll interval passed, or a background fetch finished (installed at once)."""
        return time.monotonic() - self.last_poll >= self.cfg.sampler.weight_poll_s or self.sync.has_result()

    def _refresh_in_flight(self):
        """sampler.weight_updates=in_flight: the engine asks between decode chunks; a newly installed version is
        returned as (params, version) and continues every live sequence."""
        if not self._poll_due():
            return None
        before = self.version
        self._poll_weights()
        return (self.params, self.version) if self.version != before else None
