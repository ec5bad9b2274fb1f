"""Admission control's bound: the groups a sampler may start are exactly those the trainer can still train within
max_staleness (checked against a step-by-step replay of the trainer's consumption), and no more than it needs."""

import pytest

from grpo_stream.common.rollouts.buffer import AdmissionState
from grpo_stream.trainer_service.ingest.admission import AdmissionControl, AdmissionLimits, admissible
from tests.support import FakeClock

LIMITS = AdmissionLimits(groups_per_step=4, max_staleness=2, steps=100)


def staleness_when_trained(step: int, ahead: int, version: int, groups_per_step: int) -> int:
    """Replay: the trainer has finished `step`; `ahead` groups are before ours; step s trains with version s-1."""
    trained_at = step + 1 + ahead // groups_per_step
    return trained_at - 1 - version


@pytest.mark.parametrize("step,version,waiting,queued", [
    (10, 10, 0, 0), (10, 10, 5, 3), (10, 9, 2, 1), (10, 8, 0, 0), (10, 7, 0, 0), (3, 3, 11, 0), (0, 0, 0, 0)])
def test_every_admitted_group_is_trained_within_max_staleness_and_one_more_would_not_be(step, version, waiting,
                                                                                          queued):
    state = AdmissionState(waiting=waiting, trained=step * 4, dropped_filtered=0, trainer_step=step)
    n = admissible(state, queued, version, LIMITS)
    ahead = waiting + queued
    for k in range(n):  # the k-th admitted group has ahead + k groups before it
        assert staleness_when_trained(step, ahead + k, version, 4) <= LIMITS.max_staleness
    assert staleness_when_trained(step, ahead + n, version, 4) > LIMITS.max_staleness


def test_a_sampler_too_far_behind_gets_nothing():
    state = AdmissionState(waiting=0, trained=40, dropped_filtered=0, trainer_step=10)
    assert admissible(state, 0, 7, LIMITS) == 0  # lag 3 > max_staleness 2


def test_no_more_groups_than_the_trainer_still_needs():
    state = AdmissionState(waiting=3, trained=392, dropped_filtered=0, trainer_step=98)
    assert admissible(state, 1, 98, LIMITS) == 2 * 4 - 3 - 1
    assert admissible(AdmissionState(0, 400, 0, 100), 0, 100, LIMITS) == 0


def test_filtered_groups_take_no_place_so_more_are_admitted():
    kept_all = admissible(AdmissionState(0, 40, 0, 10), 0, 10, LIMITS)
    half_filtered = admissible(AdmissionState(0, 40, 40, 10), 0, 10, LIMITS)
    assert (kept_all, half_filtered) == (12, 24)


def test_grants_count_every_samplers_groups_in_flight_until_answered():
    control = AdmissionControl(LIMITS, clock=FakeClock())
    state = AdmissionState(waiting=0, trained=40, dropped_filtered=0, trainer_step=10)  # room for 12
    assert control.admit(state, "a", 8, 10, 0) == (8, 0)
    assert control.admit(state, "b", 8, 10, 0) == (4, 8)  # a's 8 are ahead
    assert control.admit(state, "b", 8, 10, 4) == (0, 12)
    control.answered("a", [10] * 8)  # they reached the buffer: now counted there, not in flight
    moved = AdmissionState(waiting=8, trained=40, dropped_filtered=0, trainer_step=10)
    assert control.admit(moved, "b", 8, 10, 4) == (0, 12)
    assert control.in_flight() == {"a": 0, "b": 4}


def test_a_silent_sampler_stops_holding_places_after_its_lease():
    clock = FakeClock()
    control = AdmissionControl(AdmissionLimits(4, 2, 100, lease_s=60), clock=clock)
    state = AdmissionState(0, 40, 0, 10)
    assert control.admit(state, "dead", 12, 10, 0)[0] == 12
    assert control.admit(state, "live", 4, 10, 0)[0] == 0
    clock.advance(61)
    assert control.admit(state, "live", 4, 10, 0)[0] == 4
    assert "dead" not in control.in_flight()


def test_sampler_ids_beyond_the_bound_forget_the_one_silent_longest():
    """A token may speak for any `<name>-<n>`: the map of sampler ids stays bounded however many are invented."""
    clock = FakeClock()
    control = AdmissionControl(AdmissionLimits(4, 2, 100, max_samplers=3), clock=clock)
    state = AdmissionState(0, 40, 0, 10)
    for i in range(1000):
        control.admit(state, f"s-{i}", 0, 10, 0)
        clock.advance(1)
    assert set(control.in_flight()) == {"s-997", "s-998", "s-999"}
    control.admit(state, "s-997", 0, 10, 0)  # heard from again: now the newest
    control.admit(state, "s-1000", 0, 10, 0)
    assert set(control.in_flight()) == {"s-997", "s-999", "s-1000"}


def test_groups_started_now_must_not_push_older_groups_in_flight_past_the_bound():
    """A fresh sampler's groups may arrive before a lagging sampler's: they are admitted only as far as the
    lagging sampler's groups still train in time behind them."""
    control = AdmissionControl(LIMITS, clock=FakeClock())
    state = AdmissionState(0, 40, 0, 10)
    assert control.admit(state, "behind", 2, 8, 0) == (2, 0)  # version 8 (lag 2): room for 4
    assert control.admit(state, "fresh", 8, 10, 0) == (2, 2)  # alone it would get 10
    control.answered("behind", [8, 8])  # in the buffer: nothing can overtake them now
    assert control.admit(AdmissionState(2, 40, 0, 10), "fresh", 8, 10, 2) == (8, 4)


def test_the_ingest_follows_the_samplers_own_count_downwards_only():
    """Groups a sampler discarded (or that arrived while it asked) are taken from the oldest version; a report of
    more than was granted (a lie, or an ingest restart) counts nothing: another sampler's grants never depend on it."""
    control = AdmissionControl(LIMITS, clock=FakeClock())
    state = AdmissionState(0, 40, 0, 10)
    assert control.admit(state, "a", 3, 9, 0)[0] == 3
    assert control.admit(state, "a", 3, 10, 3)[0] == 3
    control.admit(state, "a", 0, 10, 3)  # the sampler holds only 3 now: the version-9 ones are gone
    assert control.admit(state, "b", 12, 10, 0)[0] == 12 - 3
    fresh = AdmissionControl(LIMITS, clock=FakeClock())
    assert fresh.admit(state, "a", 12, 10, 5) == (12, 0)


def test_a_sampler_report_replaces_what_the_ingest_counted_for_it():
    """A restarted sampler reports 0 in flight: its previous process's grants no longer hold places."""
    control = AdmissionControl(LIMITS, clock=FakeClock())
    state = AdmissionState(0, 40, 0, 10)
    assert control.admit(state, "a", 12, 10, 0)[0] == 12
    assert control.admit(state, "a", 12, 10, 0)[0] == 12


def test_an_older_version_than_the_sampler_asked_with_before_counts_as_the_newer_one():
    """A sampler installs versions in order: asking at an old version (which would bound every other sampler's
    grants by it) is counted at the newest version it asked with."""
    control = AdmissionControl(LIMITS, clock=FakeClock())
    state = AdmissionState(0, 40, 0, 10)
    assert control.admit(state, "a", 2, 10, 0) == (2, 0)
    assert control.admit(state, "a", 2, 8, 2) == (2, 2)  # counted at version 10: room for 12, not for 4
    assert control.admit(state, "b", 12, 10, 0) == (8, 4)


def test_groups_in_flight_past_max_staleness_hold_no_place():
    """They will be dropped whenever they arrive: neither their count nor their version bounds a new grant."""
    control = AdmissionControl(LIMITS, clock=FakeClock())
    assert control.admit(AdmissionState(0, 40, 0, 10), "idle", 12, 10, 0) == (12, 0)
    assert control.admit(AdmissionState(0, 52, 0, 13), "b", 12, 13, 0) == (12, 0)  # lag 3 > max_staleness 2
    assert control.in_flight() == {"idle": 12, "b": 12}


def test_a_version_remembered_from_a_trainer_before_its_restart_is_forgotten():
    """A trainer restarted from an older checkpoint publishes lower versions. A sampler asking with one is judged at
    it, not at the newest version it asked with under the earlier trainer: that one would grant as if the sampler
    were fresh, groups the trainer then drops as stale."""
    control = AdmissionControl(LIMITS, clock=FakeClock())
    assert control.admit(AdmissionState(0, 200, 0, 50), "a", 12, 50, 0) == (12, 0)
    # restarted from step 40's checkpoint, now at step 44; the sampler's version 42 (lag 2) has room for one step
    assert control.admit(AdmissionState(0, 176, 0, 44), "a", 12, 42, 0) == (4, 0)


def test_groups_an_earlier_trainer_process_granted_go_first_when_a_sampler_reports_fewer():
    """After a trainer restart a sampler discards the groups of the earlier trainer's versions: its lower report
    takes those from the ingest's count, not its groups of the versions the trainer now trains."""
    control = AdmissionControl(LIMITS, clock=FakeClock())
    assert control.admit(AdmissionState(0, 200, 0, 50), "a", 3, 50, 0)[0] == 3
    restarted = AdmissionState(0, 164, 0, 41)
    assert control.admit(restarted, "a", 2, 40, 3)[0] == 2  # (still holding the 3 it drops on the restart)
    control.admit(restarted, "a", 0, 40, 2)  # they are gone: the 2 of version 40 are what it holds
    assert control.in_flight() == {"a": 2}
    assert control.admit(restarted, "b", 12, 41, 0) == (6, 2)  # bound by the version-40 groups in flight (lag 1)


def test_a_group_answered_again_is_counted_once():
    """A sampler that lost an answer sends the group again (alone, or twice in one batch): each answer took a group
    off its in-flight count, so its count fell below what it holds and it was granted past the bound."""
    control = AdmissionControl(LIMITS)
    state = AdmissionState(waiting=0, trained=0, dropped_filtered=0, trainer_step=0)
    assert control.admit(state, "a", 4, 0, 0)[0] == 4
    control.answered("a", [0], ["g1"])
    control.answered("a", [0, 0], ["g1", "g2"])
    control.answered("a", [0, 0], ["g3", "g3"])
    control.answered("b", [0], ["g4"])  # another sampler's id is its own
    assert control.in_flight() == {"a": 1}
