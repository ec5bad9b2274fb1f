"""What the weight publisher keeps per sampler id stays bounded however many ids report, for however long."""

from grpo_stream.trainer_service import publisher as publisher_module
from grpo_stream.trainer_service.publication.publisher import WeightPublisher


def test_distinct_sampler_ids_are_capped_and_their_generated_groups_stay_counted(monkeypatch):
    monkeypatch.setattr(publisher_module, "MAX_SAMPLERS", 8)
    pub = WeightPublisher()
    for k in range(50):
        pub.record(f"sampler-{k}", 0, generated=2)
    assert len(pub.installed) == len(pub.last_seen) == len(pub.generated) == len(pub.fetch_failures) == 8
    assert "sampler-49" in pub.installed and "sampler-0" not in pub.installed  # the least recently seen went
    assert pub.groups_generated() == 100


def test_each_samplers_version_history_is_trimmed():
    pub = WeightPublisher()
    for version in range(publisher_module.MAX_VERSION_HISTORY + 100):
        pub.record("sampler-0", version)
    history = pub.installed["sampler-0"]
    assert len(history) == publisher_module.MAX_VERSION_HISTORY and history[-1] == publisher_module.MAX_VERSION_HISTORY + 99


def test_silent_samplers_expire_and_a_returning_one_starts_again(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(publisher_module.time, "time", lambda: clock[0])
    pub = WeightPublisher()
    pub.record("sampler-0", 3, generated=5, throughput=(1.0, 50.0))
    pub.record("sampler-1", 3, generated=7)
    clock[0] += publisher_module.SAMPLER_EXPIRY_S / 2
    pub.record("sampler-1", 4, generated=9)
    clock[0] += publisher_module.SAMPLER_EXPIRY_S / 2 + 61
    pub.record("sampler-2", 4)  # a new id sweeps out whoever was silent too long
    assert set(pub.installed) == {"sampler-1", "sampler-2"} and "sampler-0" not in pub.throughput
    assert pub.groups_generated() == 5 + 9
    pub.record("sampler-0", 5, generated=1)  # back again: a fresh entry, its earlier groups still counted
    assert pub.installed["sampler-0"] == [5] and pub.groups_generated() == 5 + 9 + 1
