"""The restart policy `up` applies: jittered, growing waits per process, a restart budget counted within a time
window and reset by healthy uptime (not over the whole run), 'never'."""

import pytest

from grpo_stream.common.config.process import UpSection
from grpo_stream.common.config.schema import ConfigError
from grpo_stream.common.config.loading import load_config
from grpo_stream.up.supervise import Supervisor
from tests.support import FakeClock


def crash(sup: Supervisor, clock: FakeClock, name: str, uptime_s: float = 0.0) -> float | None:
    """`name` fails after `uptime_s` of running; when a restart is granted, wait for it and make it."""
    clock.advance(uptime_s)
    delay = sup.failed(name)
    if delay is not None:
        assert sup.waiting(name) and sup.due() == []  # not before its time
        clock.advance(delay)
        assert sup.due() == [name] and not sup.waiting(name)
    return delay


def test_a_crash_loop_stops_the_run_after_the_burst_with_growing_waits():
    clock = FakeClock(0.0)
    sup = Supervisor(UpSection(restart_limit_burst=3, restart_limit_interval_s=300, healthy_after_s=60,
                               restart_backoff_s=1.0), clock)
    waits = [crash(sup, clock, "sampler-0", uptime_s=2.0) for _ in range(3)]
    assert 0.5 <= waits[0] <= 1.0 and 1.0 <= waits[1] <= 2.0 and 2.0 <= waits[2] <= 4.0
    assert sup.restarts["sampler-0"] == 3
    assert crash(sup, clock, "sampler-0", uptime_s=2.0) is None  # a fourth failure within the window stops the run
    assert "3 of up.restart_limit_burst=3" in sup.budget("sampler-0")
    assert crash(sup, clock, "trainer") is not None and sup.restarts["trainer"] == 1  # budgets are per process


def test_a_long_run_survives_any_number_of_preemptions_spread_over_time():
    """The fault of issue 41: the 6th kill of one process over a long run stopped it (a lifetime budget of 5).
    Preemptions an hour apart, and a burst of them after each healthy stretch, are all healed."""
    clock = FakeClock(0.0)
    sup = Supervisor(UpSection(), clock)  # the defaults
    for _ in range(50):  # a week of hourly preemptions of Redis
        assert crash(sup, clock, "redis-server", uptime_s=3600.0) is not None
    for _ in range(10):  # several quick kills in a row, each after the process ran healthy for a while
        assert crash(sup, clock, "trainer", uptime_s=UpSection().healthy_after_s + 1) is not None
    assert sup.restarts["redis-server"] == 50 and sup.restarts["trainer"] == 10


def test_restarts_older_than_the_window_stop_counting():
    clock = FakeClock(0.0)
    sup = Supervisor(UpSection(restart_limit_burst=2, restart_limit_interval_s=100, healthy_after_s=1000,
                               restart_backoff_s=1.0), clock)
    assert crash(sup, clock, "ingest") is not None and crash(sup, clock, "ingest") is not None
    clock.advance(101)  # both restarts leave the window (still short of healthy_after_s: not reset by uptime)
    assert crash(sup, clock, "ingest") is not None


def test_healthy_uptime_resets_the_back_off():
    clock = FakeClock(0.0)
    sup = Supervisor(UpSection(restart_backoff_s=1.0, restart_backoff_max_s=30, healthy_after_s=30), clock)
    waits = [crash(sup, clock, "sampler-1", uptime_s=1.0) for _ in range(4)]
    assert waits[3] >= 4.0  # 8 s step, jittered into [4, 8]
    assert crash(sup, clock, "sampler-1", uptime_s=31.0) <= 1.0  # back to the first step after a healthy run


def test_never_restarts_nothing():
    sup = Supervisor(UpSection(restart="never"), FakeClock(0.0))
    assert sup.failed("trainer") is None and sup.due() == []


def test_the_old_lifetime_count_is_refused_with_its_replacement_named():
    with pytest.raises(ConfigError, match="up.max_restarts .* replaced .* up.restart_limit_burst"):
        load_config(None, ["up.max_restarts=30"])
    with pytest.raises(ConfigError, match="restart_backoff_max_s"):
        load_config(None, ["up.restart_backoff_s=60", "up.restart_backoff_max_s=10"])
