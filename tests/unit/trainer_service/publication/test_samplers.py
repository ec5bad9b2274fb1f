"""What the sampler registry keeps per sampler id stays bounded however many ids report, for however long."""

from grpo_stream.trainer_service.publication import samplers as samplers_module
from grpo_stream.trainer_service.publication.samplers import SamplerRegistry


def test_distinct_sampler_ids_are_capped_and_their_generated_groups_stay_counted(monkeypatch):
    monkeypatch.setattr(samplers_module, "MAX_SAMPLERS", 8)
    reg = SamplerRegistry()
    for k in range(50):
        reg.record(f"sampler-{k}", 0, failures=0, generated=2)
    assert len(reg.installed) == len(reg.last_seen) == len(reg.generated) == len(reg.fetch_failures) == 8
    assert "sampler-49" in reg.installed and "sampler-0" not in reg.installed  # the least recently seen went
    assert reg.groups_generated() == 100


def test_each_samplers_version_history_is_trimmed():
    reg = SamplerRegistry()
    for version in range(samplers_module.MAX_VERSION_HISTORY + 100):
        reg.record("sampler-0", version)
    history = reg.installed["sampler-0"]
    most = samplers_module.MAX_VERSION_HISTORY
    assert len(history) == most and history[-1] == most + 99


def test_silent_samplers_expire_and_a_returning_one_starts_again(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(samplers_module.time, "time", lambda: clock[0])
    reg = SamplerRegistry()
    reg.record("sampler-0", 3, generated=5, throughput=(1.0, 50.0))
    reg.record("sampler-1", 3, generated=7)
    clock[0] += samplers_module.SAMPLER_EXPIRY_S / 2
    reg.record("sampler-1", 4, generated=9)
    clock[0] += samplers_module.SAMPLER_EXPIRY_S / 2 + 61
    reg.record("sampler-2", 4)  # a new id sweeps out whoever was silent too long
    assert set(reg.installed) == {"sampler-1", "sampler-2"} and "sampler-0" not in reg.throughput
    assert reg.groups_generated() == 5 + 9
    reg.record("sampler-0", 5, generated=1)  # back again: a fresh entry, its earlier groups still counted
    assert reg.installed["sampler-0"] == [5] and reg.groups_generated() == 5 + 9 + 1


def test_a_late_report_of_a_process_is_not_taken_for_a_restart():
    """Reports are unary calls with a short deadline: one sent at 10 groups may be served after the one sent at 12.
    Read as a restart (its count fell), the 12 were counted twice; a new process (a new id) adds its own count."""
    reg = SamplerRegistry()
    reg.record("sampler-0", 3, generated=12, process="a1")
    reg.record("sampler-0", 3, generated=10, process="a1")  # late
    assert reg.groups_generated() == 12
    reg.record("sampler-0", 4, generated=3, process="b2")  # restarted: its new process counts from 0
    reg.record("sampler-0", 4, generated=2, process="b2")
    assert reg.groups_generated() == 12 + 3
    reg.record("sampler-0", 4, generated=1)  # a sampler sending no id: a fall is a restart, as before
    reg.record("sampler-0", 4, generated=0)
    assert reg.groups_generated() == 12 + 3 + 1


def test_processes_kept_apart_per_sampler_are_capped_and_still_counted(monkeypatch):
    monkeypatch.setattr(samplers_module, "MAX_PROCESSES", 4)
    reg = SamplerRegistry()
    for k in range(20):  # a crash-looping sampler: a process per start
        reg.record("sampler-0", 0, generated=2, process=f"p{k}")
    assert len(reg.generated["sampler-0"]) <= 4 and reg.groups_generated() == 40
