"""The `checkpoint` transport's directory across trainer restarts: a final re-publication reaches the samplers, a
resumed trainer keeps its own newest versions, and what a dead trainer left half written goes."""

import jax.numpy as jnp

from grpo_stream.common.weights.checkpoint_store import CheckpointWeightStore
from grpo_stream.common.weights.checkpoint_transport import CheckpointFetcher, CheckpointSink

WEIGHTS = {"w": jnp.ones((2, 2))}


def _versions(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("v"))


def test_marking_an_already_published_version_final_reaches_the_samplers(tmp_path):
    """A resumed run that had already ended publishes its last version at start, then again as final: samplers
    read LATEST only, so the final flag must be written there or they never stop."""
    store = CheckpointWeightStore(str(tmp_path), keep=3)
    sink, samplers = CheckpointSink(store), CheckpointFetcher(store)
    sink.put(5, WEIGHTS, False, "e1", 0.0)
    assert not samplers.latest(-1).final
    manifest, _ = sink.put(5, WEIGHTS, True, "e1", 0.0)
    assert manifest.final and samplers.latest(5).final and samplers.latest(5).version == 5


def test_a_resumed_trainer_keeps_its_own_newest_versions_not_the_dead_ones_higher_numbers(tmp_path):
    """The restarted trainer publishes below the numbers its predecessor reached (publications run ahead of
    checkpoints): by number, the old epoch's directories would hold the newest places and each new version would
    delete the one just before it, under a sampler still restoring it."""
    store = CheckpointWeightStore(str(tmp_path), keep=3)
    for version in range(15, 21):
        store.save(version, WEIGHTS, False, "aaaa")
    store.save(12, WEIGHTS, False, "bbbb")
    store.save(13, WEIGHTS, False, "bbbb")
    assert "v0000000012-bbbb" in _versions(tmp_path)
    store.save(14, WEIGHTS, False, "bbbb")
    assert _versions(tmp_path) == ["v0000000012-bbbb", "v0000000013-bbbb", "v0000000014-bbbb"]
    assert store.latest()["version"] == 14 and store.latest()["epoch"] == "bbbb"


def test_what_a_dead_trainer_left_half_written_is_removed_and_the_live_ones_kept(tmp_path):
    store = CheckpointWeightStore(str(tmp_path), keep=3)
    store.save(7, WEIGHTS, False, "dead")
    (tmp_path / "v0000000008-dead").mkdir()  # killed mid-save: no COMPLETE marker, never read, never pruned before
    (tmp_path / "v0000000008-dead.orbax-checkpoint-tmp-1234").mkdir()
    (tmp_path / "LATEST.dead.tmp").write_text("{")
    store.save(8, WEIGHTS, False, "live")
    assert _versions(tmp_path) == ["v0000000007-dead", "v0000000008-live"]  # a complete one stays within `keep`
    assert not (tmp_path / "LATEST.dead.tmp").exists()
    assert store.latest()["version"] == 8
