"""With sampler.weight_updates=drain, a version that arrives before any group started with the installed one waits
for that version's turn (a group started with it, or the feeder found it could start none), without holding the
feeder. It was: a sampler whose versions came faster than it installed them drained for each one, nothing in flight,
installed it, and met the next staged at once: the e2e no-mixed-versions run saw 79 installs and 2 groups in 57 s.
A restarted trainer's version (another epoch) never waits for a turn: the old epoch's groups could not be sent."""

import types

from grpo_stream.sampler_service.weight_sync import Installed
from tests.unit.sampler_service.test_feeder import Client, feeder
from tests.unit.sampler_service.test_weights_in_use import weights_in_use


def staged_before_any_group(cfg, epoch="old"):
    """Drain mode, version 50 just installed (nothing in flight, no group started with it), version 51 staged."""
    weights, client, stream = weights_in_use(cfg, "drain")
    stream.episodes_in_flight = 0
    weights.sync.fetched = Installed(51, "params-v51", False, 0.0, 0, epoch)
    weights.poll()
    return weights, stream


def test_a_version_staged_before_any_group_waits_and_lets_the_feeder_start_one(small_cfg):
    weights, stream = staged_before_any_group(small_cfg)
    for _ in range(3):  # the engine's scheduling points come and go: it is not installed, nor a drain begun
        assert weights.staged.refresh() is None and weights.version == 50
    assert not weights.staged.waiting() and stream.accepting  # the feeder may start groups; outside requests too
    stream.episodes_in_flight = 4  # the feeder starts a group with version 50 ...
    weights.group_started()
    assert weights.staged.waiting()  # ... and then no more: the drain for 51 begins
    assert weights.staged.refresh() is None and not stream.accepting and weights.version == 50
    stream.episodes_in_flight = 0  # the group ended with version 50
    assert weights.staged.refresh() == ("params-v51", 51) and stream.accepting
    assert not weights.staged.waiting()


def test_a_version_staged_while_the_feeder_can_start_nothing_is_installed_at_once(small_cfg):
    """Admission granting none (or a full backlog, too stale weights) is the installed version's turn: waiting for a
    group that cannot start would keep the sampler on old weights while the trainer moves on."""
    weights, stream = staged_before_any_group(small_cfg)
    assert weights.staged.refresh() is None
    weights.feeder_passed()
    assert weights.staged.waiting()
    assert weights.staged.refresh() == ("params-v51", 51)
    weights.sync.fetched = Installed(52, "params-v52", False, 0.0, 0, "old")  # the turn is per installed version
    weights.poll()
    assert weights.staged.refresh() is None and not weights.staged.waiting()


def test_a_restarted_trainer_s_version_is_drained_for_at_once(small_cfg):
    weights, stream = staged_before_any_group(small_cfg, epoch="new")
    assert weights.staged.waiting()
    assert weights.staged.refresh() == ("params-v51", 51) and weights.epoch == "new"


def test_versions_published_faster_than_installs_still_let_each_start_groups(small_cfg):
    """The feeder (Sampler._feed) and the weights in use together: each install is followed at once by a newer
    version staged; every installed version still starts groups, the next is installed once they ended."""
    weights, stream = staged_before_any_group(small_cfg)
    sampler = feeder(small_cfg, Client(), types.SimpleNamespace(pending=lambda: 0), [])
    sampler.weights = weights
    started_with = []
    sampler.stream = types.SimpleNamespace(
        room=lambda rows, slots: rows, in_flight=lambda: [],
        start=lambda work, kind, version: started_with.append(version))
    for version in range(51, 55):
        sampler._feed(sampler)  # groups start with the installed version, then the drain holds the feeder
        count = len(started_with)
        sampler._feed(sampler)
        assert len(started_with) == count  # held: no group starts while a drain waits
        assert weights.staged.refresh() == (f"params-v{version}", version)  # their episodes ended (none in flight)
        weights.sync.fetched = Installed(version + 1, f"params-v{version + 1}", False, 0.0, 0, "old")
        weights.poll()  # the next version, staged right after the install
    assert sorted(set(started_with)) == [50, 51, 52, 53]
    assert all(started_with.count(v) == started_with.count(50) > 0 for v in (51, 52, 53))


def test_a_feeder_admission_grants_nothing_counts_as_the_version_s_turn(small_cfg):
    weights, stream = staged_before_any_group(small_cfg)
    sampler = feeder(small_cfg, Client(), types.SimpleNamespace(pending=lambda: 0), [])
    sampler.weights = weights
    sampler.admission = types.SimpleNamespace(admit=lambda wanted, version, holding: 0)
    sampler.stream = types.SimpleNamespace(room=lambda rows, slots: rows, in_flight=lambda: [])
    sampler._feed(sampler)
    assert weights.staged.refresh() == ("params-v51", 51)
