"""A sampler holds at most one version beside the one in use: a newer version is not fetched while a fetched one waits
for the engine (a drain for the groups in flight; a restarted trainer's version, drained for in every mode).

It was: the feeder fetched version 2 while version 1 waited for a drain, so the devices held three copies of the
weights (in use, waiting, arriving), where `grpo-stream plan` counts two (`fetch_buffer`): a GPU sized by the plan ran
out of memory whenever a drain outlasted a publication. The newest version is still checked for meanwhile, so the lag
is known and a final mark on the waiting version ends the stream as before.
"""

import threading

from grpo_stream.common.weights.snapshot import manifest_of
from grpo_stream.sampler_service.weights_in_use import WeightsInUse
from tests.unit.sampler_service.test_weight_sync import Fetcher, sync_for


class Stream:
    """What WeightsInUse asks of a running RolloutStream: its episodes in flight (a drain waits for 0)."""

    def __init__(self, episodes_in_flight: int):
        self.episodes_in_flight = episodes_in_flight

    def set_accepting(self, accepting: bool) -> None:
        pass


def drain_sampler(tiny_parts):
    """(weights in use with version 0 installed and a stream of one episode in flight, fetcher, publish(version))."""
    cfg, _, _, model = tiny_parts
    cfg = cfg.model_copy(update={"sampler": cfg.sampler.model_copy(update={"weight_updates": "drain"})})
    named = model.to_named_numpy()
    shapes = {n: (a.shape, a.dtype) for n, a in named.items()}
    fetcher = Fetcher(named)

    def publish(version: int, final: bool = False) -> None:
        fetcher.manifest = manifest_of(version, shapes, final, "e1", 0.0, 0, "fake")

    weights = WeightsInUse(cfg, "sampler-0", threading.Event())
    weights.attach(sync_for(model, fetcher), None, None)
    weights.poll()  # version 0, before the stream
    weights.stream_started(Stream(episodes_in_flight=1), None)
    weights.group_started()  # the group in flight, started with version 0
    return weights, fetcher, publish


def test_no_version_is_fetched_while_another_waits_for_the_engine(tiny_parts):
    weights, fetcher, publish = drain_sampler(tiny_parts)
    publish(1)
    weights.poll()
    assert fetcher.fetches == 2 and weights.staged.refresh() is None  # version 1 waits for the drain
    publish(2)
    for _ in range(3):
        weights.poll()
    assert fetcher.fetches == 2, "version 2 fetched while version 1 waited: three copies of the weights"
    assert weights.sync.latest_seen == 2 and weights.sync.lag() == 2  # checked for all the same
    weights.stream.episodes_in_flight = 0  # the drain ends: the engine takes version 1 ...
    assert weights.staged.refresh()[1] == 1
    weights.poll()  # ... and version 2 comes next, drained for once a group started with version 1
    assert fetcher.fetches == 3 and weights.staged.holding()
    weights.group_started()
    assert weights.staged.refresh()[1] == 2 and weights.version == 2


def test_a_final_mark_on_the_waiting_version_still_ends_the_stream(tiny_parts):
    weights, fetcher, publish = drain_sampler(tiny_parts)
    publish(1)
    weights.poll()
    publish(1, final=True)  # the trainer's last step: the version waiting is the final one
    weights.poll()
    assert weights.final_reached() and fetcher.fetches == 2
    assert weights.install_final() and weights.version == 1
