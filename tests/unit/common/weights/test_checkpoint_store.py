"""The `checkpoint` transport's directory across trainer restarts: a final re-publication reaches the samplers, a
resumed trainer keeps its own newest versions, and what a dead trainer left half written goes."""

import jax.numpy as jnp

from grpo_stream.common.weights.checkpoint_store import CheckpointError, CheckpointWeightStore
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


def test_a_version_pruned_while_a_sampler_restores_it_is_retried_not_fatal(tmp_path):
    """The trainer prunes the version a sampler is restoring (weights.keep_versions newer ones came out): the
    restore fails part-way, with TensorStore's bare Exception for a data file gone, which must be a CheckpointError
    the sampler retries with the newest version, not an error that stops the sampler. Pruning removes the marker
    first, so the failure is seen as a pruned version whatever order the rest goes in."""
    import jax

    from grpo_stream.sampler_service.weight_sync import retryable

    trainer, reader = CheckpointWeightStore(str(tmp_path), keep=2), CheckpointWeightStore(str(tmp_path), keep=2)
    sink, samplers = CheckpointSink(trainer), CheckpointFetcher(reader)
    weights = {"w": jnp.arange(4096.0).reshape(64, 64)}  # small or constant arrays live in the index, not a data file
    sink.put(1, weights, False, "ep", 0.0)
    manifest = samplers.latest(-1)
    restore = reader._checkpointer.restore

    def pruned_part_way(path, target):
        """The prune starts once the restore checked the marker: marker gone, then the data files, the rest not
        yet (the same read with the whole directory gone raises FileNotFoundError, which was always retried)."""
        (path / "COMPLETE").unlink()
        for data in (path / "ocdbt.process_0" / "d").iterdir():
            data.unlink()
        return restore(path, target)

    targets = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32,
                                         sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    reader._checkpointer.restore = pruned_part_way
    try:
        samplers.fetch(manifest, targets)
    except Exception as exc:  # noqa: BLE001 - classified below
        assert isinstance(exc, CheckpointError) and retryable(exc), exc
    else:
        raise AssertionError("a restore of a pruned version succeeded")


def test_pruning_takes_a_versions_marker_before_its_data(tmp_path, monkeypatch):
    """Whatever order the rest of a pruned version goes in (or if its removal fails part-way), its marker is gone
    first, so a sampler whose restore fails meanwhile is told to poll again rather than stopped."""
    store = CheckpointWeightStore(str(tmp_path), keep=2)
    store.save(1, WEIGHTS, False, "ep")
    version_dir = tmp_path / "v0000000001-ep"
    path = store.root / version_dir.name

    def failing_rmtree(self, *args, **kwargs):
        raise OSError("busy: a reader holds a file open")

    monkeypatch.setattr(type(path), "rmtree", failing_rmtree)
    store._remove(path)
    assert version_dir.is_dir() and not (version_dir / "COMPLETE").exists()
