"""The sampler's lag (latest version seen minus the installed one) is written by three threads: the background fetch,
the feeder's reports to the trainer and the engine's installs. An install of a restarted trainer's first version
(its numbers start again lower) must not be undone by a report that read the old figure just before it: the old
epoch's number left behind made the lag huge, and the sampler held generation as too stale until the new trainer
caught up with a trainer that no longer exists."""

import threading

from grpo_stream.sampler_service.weight_sync import Installed, WeightSync
from tests.unit.sampler_service.test_weight_sync import Fetcher, sync_for


class Reply:
    latest_version = 3  # the restarted trainer's newest version


class TrainerStub:
    def ReportVersion(self, request, timeout):
        return Reply()


class InstallDuringRead:
    """A `latest_seen` that, the first time it is read while armed, has another thread install `got` (the engine's
    install landing between a report's read of the figure and its write), and gives that thread a moment to run."""

    def __init__(self, sync, got: Installed):
        self.sync, self.got, self.armed, self.value = sync, got, False, -1
        self.installer: threading.Thread | None = None

    def read(self) -> int:
        value = self.value  # what the reader got; the install lands after it
        if self.armed:
            self.armed = False
            self.installer = threading.Thread(target=self.sync.mark_installed, args=(self.got, False))
            self.installer.start()
            self.installer.join(0.5)  # done at once unless a lock keeps it out until this update is written
        return value


def test_a_report_does_not_undo_the_install_of_a_restarted_trainers_lower_version(tiny_parts):
    _, _, _, model = tiny_parts
    sync = sync_for(model, Fetcher(model.to_named_numpy()), max_staleness=4)
    sync._report_stub = TrainerStub()
    sync.mark_installed(Installed(100, None, False, 0.0, 0, "old-epoch"), report=False)
    seen = InstallDuringRead(sync, Installed(2, None, False, 0.0, 0, "new-epoch"))
    seen.value = sync.__dict__.pop("latest_seen")
    sync.__class__ = type("Watched", (WeightSync,), {"latest_seen": property(
        lambda _: seen.read(), lambda _, value: setattr(seen, "value", value))})
    seen.armed = True
    sync.report()
    seen.installer.join()
    assert sync.installed_version == 2
    assert sync.latest_seen in (2, 3) and sync.lag() <= 1 and not sync.too_stale()
