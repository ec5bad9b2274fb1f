"""A restarted trainer's weights (a new trainer epoch, its numbers from its checkpoint: often lower) never continue a
sequence begun with the old trainer's, even with sampler.weight_updates=in_flight: a completion drawn by v50 then
v40 records versions [50, 40], which the ingest refuses (version runs must not decrease). The new epoch is drained
for (no group starts, the groups in flight end first), and from its fetch on no group of the old epoch is sent: the
new trainer would read the old numbers as its own."""

import threading
import time
import types

import jax
from grpc_health.v1 import health_pb2

from grpo_stream.common.model.sharding import make_mesh
from grpo_stream.sampler_service.weight_sync import Installed, WeightSync
from grpo_stream.sampler_service.weights_in_use import WeightsInUse


class FakeSync:
    """The weight sync as WeightsInUse uses it: `fetched` is what the next poll returns."""

    def __init__(self, installed: Installed):
        self.installed, self.fetched, self.failures = installed, None, 0

    @property
    def installed_epoch(self) -> str:
        return self.installed.epoch

    def poll(self):
        got, self.fetched = self.fetched, None
        return got

    def lag(self) -> int:
        return 0

    def mark_installed(self, got, report=True) -> None:
        self.installed = got


def weights_in_use(cfg, mode: str, epoch: str = "old", version: int = 50):
    cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"weight_updates": mode})})
    weights = WeightsInUse(cfg, "sampler-0", threading.Event())
    client = types.SimpleNamespace(min_version=0, epoch=epoch)
    weights.attach(FakeSync(Installed(version, "params-v50", False, 0.0, 0, epoch)), client, None)
    stream = types.SimpleNamespace(episodes_in_flight=2, accepting=True)
    stream.set_accepting = lambda accepting: setattr(stream, "accepting", accepting)
    weights.stream_started(stream, None)
    return weights, client, stream


def test_a_restarted_trainer_s_version_waits_for_the_groups_in_flight_even_in_flight_mode(small_cfg):
    weights, client, stream = weights_in_use(small_cfg, "in_flight")
    weights.sync.fetched = Installed(40, "params-v40", False, 0.0, 0, "new")
    weights.poll()
    assert weights.staged.refresh() is None and weights.version == 50  # not installed into the sequences in flight
    assert weights.staged.waiting() and not stream.accepting  # the feeder starts no group, outside requests wait
    assert client.epoch == "new"  # the old trainer's groups still to come are not sent
    stream.episodes_in_flight = 0
    assert weights.staged.refresh() == ("params-v40", 40) and weights.version == 40 and weights.epoch == "new"
    assert not weights.staged.waiting() and stream.accepting


def test_a_version_of_the_same_trainer_still_joins_the_sequences_in_flight(small_cfg):
    weights, client, stream = weights_in_use(small_cfg, "in_flight")
    weights.sync.fetched = Installed(51, "params-v51", False, 0.0, 0, "old")
    weights.poll()
    assert not weights.staged.waiting()
    assert weights.staged.refresh() == ("params-v51", 51) and client.epoch == "old"
    assert client.min_version == max(0, 51 - small_cfg.trainer.max_staleness)


def test_the_feeder_told_no_drain_waits_already_reads_the_new_epoch_s_version(small_cfg):
    """The engine takes a drained-for version and installs it; a feeder that asks meanwhile whether a drain waits
    must not hear 'no' while the old trainer's version is still the one in use: it would start a group labelled with
    the old epoch and version that the engine draws with the new weights, and the client would drop it unsent."""
    weights, client, stream = weights_in_use(small_cfg, "in_flight")
    weights.sync.fetched = Installed(40, "params-v40", False, 0.0, 0, "new")
    weights.poll()
    stream.episodes_in_flight = 0
    entered, go, seen = threading.Event(), threading.Event(), []
    install = weights.staged.install

    def install_held_open(got) -> None:
        entered.set()
        go.wait(10)
        install(got)

    weights.staged.install = install_held_open
    engine = threading.Thread(target=weights.staged.refresh)
    engine.start()
    assert entered.wait(10)
    feeder = threading.Thread(target=lambda: seen.append((weights.staged.waiting(), weights.version,
                                                          weights.epoch)))
    feeder.start()
    feeder.join(0.5)  # time for a feeder that is not held back to read what it would start a group with
    go.set()
    engine.join(10)
    feeder.join(10)
    assert seen == [(False, 40, "new")]


def test_a_restarted_trainer_s_version_of_the_same_number_is_reported_when_installed(small_cfg):
    """A trainer restarted from the checkpoint of the version the sampler has republishes it under its new epoch: the
    install is news to the new trainer (it records only reports of its own epoch), though the number is the same."""
    weights, client, stream = weights_in_use(small_cfg, "in_flight")
    reports = []
    weights.sync.report = lambda: reports.append((weights.version, weights.epoch))
    weights.report_installed()
    weights.sync.fetched = Installed(50, "params-new-v50", False, 0.0, 0, "new")
    weights.poll()
    stream.episodes_in_flight = 0
    assert weights.staged.refresh() == ("params-new-v50", 50)
    weights.report_installed()
    weights.report_installed()  # nothing new since: not reported again
    assert reports == [(50, "old"), (50, "new")]


class NothingPublished:
    """A trainer up but not publishing yet (its warm start): every manifest check finds nothing; counts them."""

    def __init__(self):
        self.checks = 0

    def latest(self, installed_version):
        self.checks += 1
        return None


def test_waiting_for_the_first_weights_checks_at_most_every_weight_poll_s(tiny_parts):
    """A trainer's warm start or eval_before may take hours: the wait for its first weights checks for them every
    sampler.weight_poll_s (the operator's bound on the manifest calls each sampler makes), not at every 50 ms turn
    of the wait, where each check of a background fetch was a new thread and a GetManifest call (20 a second per
    sampler, whatever weight_poll_s said)."""
    cfg, _, _, model = tiny_parts
    cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"weight_poll_s": 60.0}),
                                 "weights": cfg.weights.model_copy(update={"background_fetch": True})})
    stop, fetcher = threading.Event(), NothingPublished()
    sync = WeightSync(fetcher, model, make_mesh(1, 1, jax.devices()[:1], "sampler.mesh.tp"), "sampler-0",
                      background=True)
    weights = WeightsInUse(cfg, "sampler-0", stop)
    weights.attach(sync, None, None)
    serving = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
    beats = []
    health = types.SimpleNamespace(Check=lambda request, timeout=None: serving)
    waiter = threading.Thread(target=weights.await_first, args=(health, lambda: beats.append(1)))
    waiter.start()
    try:
        while len(beats) < 2 and waiter.is_alive():  # two health checks, a second apart: many turns of the wait
            time.sleep(0.05)
    finally:
        stop.set()
        waiter.join(10)
        sync.close()
    assert len(beats) >= 2 and fetcher.checks == 1  # one check per weight_poll_s (60 s)


def test_the_first_weight_check_is_due_at_once_whatever_the_clock_reads(small_cfg, monkeypatch):
    """The last check was taken as at monotonic time 0: on a machine up for less than sampler.weight_poll_s (a fresh
    VM or container, whose monotonic clock starts at its boot) the first check waited for the clock to reach it."""
    from grpo_stream.sampler_service import weights_in_use  # noqa: PLC0415 - its clock, set below

    cfg = small_cfg.model_copy(update={"sampler": small_cfg.sampler.model_copy(update={"weight_poll_s": 60.0})})
    # its clock five seconds after the boot (its own name `time` only: the process's clock stays)
    monkeypatch.setattr(weights_in_use, "time", types.SimpleNamespace(monotonic=lambda: 5.0))
    weights = WeightsInUse(cfg, "sampler-0", threading.Event())
    weights.sync = types.SimpleNamespace(has_result=lambda: False)
    assert weights.poll_due()
