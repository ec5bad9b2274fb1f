"""A sampler that stopped is forgotten after SAMPLER_EXPIRY_S even when no new sampler id ever reports: with a fixed
set of samplers its lag grew with every version for the rest of the run."""

from grpo_stream.trainer_service.publication import samplers as samplers_module
from grpo_stream.trainer_service.publication.samplers import SamplerRegistry


def test_a_stopped_sampler_leaves_the_status_while_the_others_keep_reporting(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(samplers_module.time, "time", lambda: clock[0])
    reg = SamplerRegistry()
    reg.record("sampler-0", 3, generated=5)
    reg.record("sampler-1", 3, generated=7)
    for version in range(4, 4 + 100):  # sampler-0 stopped; sampler-1 reports each version, a minute apart
        clock[0] += samplers_module.SAMPLER_EXPIRY_S / 50
        reg.record("sampler-1", version, generated=7 + version)
    assert [row["sampler_id"] for row in reg.status(103)] == ["sampler-1"]
    assert "sampler-0" not in reg.installed and reg.groups_generated() == 5 + 7 + 103


def test_readers_forget_stopped_samplers_when_none_reports_any_more(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(samplers_module.time, "time", lambda: clock[0])
    reg = SamplerRegistry()
    reg.record("sampler-0", 3)
    clock[0] += samplers_module.SAMPLER_EXPIRY_S + 61
    assert reg.samplers_at(3) == {} and reg.status(9) == []


def test_a_sampler_silent_past_the_expiry_that_reports_again_keeps_its_counts(monkeypatch):
    """Its own report does not sweep it out first: its process's count would be counted twice (retired + again)."""
    clock = [1000.0]
    monkeypatch.setattr(samplers_module.time, "time", lambda: clock[0])
    reg = SamplerRegistry()
    reg.record("sampler-0", 3, generated=10, process="a1")
    clock[0] += samplers_module.SAMPLER_EXPIRY_S + 61
    reg.record("sampler-0", 4, generated=12, process="a1")
    assert reg.groups_generated() == 12 and reg.installed["sampler-0"] == [3, 4]
