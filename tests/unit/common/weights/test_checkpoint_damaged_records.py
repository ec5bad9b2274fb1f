"""The `checkpoint` transport's records as a sampler reads them: LATEST damaged in ways that pass as JSON text or
parse as a record (bytes that are not UTF-8, a JSON nesting past the parser, shapes past any manifest, adapters that
are not a base64 AdapterVersion) is a failure the sampler retries, never one that stops it; and a version's location
is read in the sampler's own weights.checkpoint_dir (mounted at another path than the trainer's, or a location that
points outside it)."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.weights.checkpoint_store import CheckpointError, CheckpointWeightStore
from grpo_stream.common.weights.checkpoint_transport import CheckpointFetcher, CheckpointSink
from grpo_stream.sampler_service.weight_sync import retryable

WEIGHTS = {"w": jnp.ones((2, 2))}


def _targets(shape=(2, 2)):
    return {"w": jax.ShapeDtypeStruct(shape, jnp.float32,
                                      sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}


def _damage(record: dict, kind: str) -> bytes:
    if kind == "not-utf8":
        return b"\xff\xfe" + json.dumps(record).encode()
    if kind == "deep":
        return b"[" * 100_000 + b"]" * 100_000
    if kind == "huge-shape":
        return json.dumps({**record, "tensors": [["w", [1 << 31, 1 << 31], "float32"]]}).encode()
    return json.dumps({**record, "adapters": {"not-base64": "!!!x", "not-a-message": "AAAA"}[kind]}).encode()


@pytest.mark.parametrize("kind, named", [
    ("not-utf8", "unreadable"), ("deep", "unreadable"), ("huge-shape", "tensors:"),
    ("not-base64", "adapters:"), ("not-a-message", "adapters:")])
def test_a_latest_damaged_past_json_is_retried_and_the_next_publish_recovers(tmp_path, kind, named):
    store = CheckpointWeightStore(str(tmp_path), keep=3)
    samplers = CheckpointFetcher(store)
    store.save(4, WEIGHTS, False, "e1")
    record = json.loads((tmp_path / "LATEST").read_text())
    (tmp_path / "LATEST").write_bytes(_damage(record, kind))
    with pytest.raises(CheckpointError) as err:
        samplers.latest(4)
    assert named in str(err.value) and retryable(err.value)
    store.save(5, WEIGHTS, False, "e1")
    assert samplers.latest(4).version == 5


def test_a_sampler_that_mounts_the_directory_elsewhere_restores_from_its_own_path(tmp_path):
    """The trainer writes under its path; the sampler's weights.checkpoint_dir is the same storage at another path
    (the trainer's path does not exist on the sampler's machine)."""
    trainer_dir, sampler_dir = tmp_path / "trainer-mount", tmp_path / "sampler-mount"
    weights = {"w": jnp.arange(4.0).reshape(2, 2)}
    CheckpointSink(CheckpointWeightStore(str(trainer_dir))).put(3, weights, False, "ep", 0.0)
    shutil.move(trainer_dir, sampler_dir)
    samplers = CheckpointFetcher(CheckpointWeightStore(str(sampler_dir)))
    manifest = samplers.latest(-1)
    assert manifest.location.startswith(str(trainer_dir))
    np.testing.assert_array_equal(samplers.fetch(manifest, _targets())["w"], weights["w"])


@pytest.mark.parametrize("outside", ["other-run/v0000000001-x", "run/../other-run/v0000000001-x"])
def test_a_location_outside_the_directory_is_never_read(tmp_path, outside):
    """A LATEST whose location names a directory elsewhere (another run's store, or `..`) is refused as a
    damaged record, retried, and no weights from there are installed."""
    CheckpointWeightStore(str(tmp_path / "other-run")).save(1, {"w": jnp.full((2, 2), 7.0)}, False, "x")
    store = CheckpointWeightStore(str(tmp_path / "run"))
    store.save(1, WEIGHTS, False, "e1")
    record = json.loads((tmp_path / "run" / "LATEST").read_text())
    (tmp_path / "run" / "LATEST").write_text(json.dumps({**record, "location": str(tmp_path / outside)}))
    samplers = CheckpointFetcher(store)
    with pytest.raises(CheckpointError) as err:
        samplers.fetch(samplers.latest(-1), _targets())
    assert retryable(err.value)


def test_pruning_deletes_only_what_the_store_wrote_in_a_directory_shared_with_other_files(tmp_path):
    """weights.checkpoint_dir may be a shared disk's or a bucket's top: files and directories of the user's there
    (named v..., base-..., *.tmp) outlive every publication and pruning; the store's own leftovers still go."""
    theirs = ["venv", "vocab.json", "v2", "base-model", "notes.tmp"]
    for name in theirs:
        (tmp_path / name).mkdir() if "." not in name else (tmp_path / name).write_text("mine")
    (tmp_path / "venv" / "keep.txt").write_text("mine")
    (tmp_path / "v0000000003-dead.orbax-checkpoint-tmp-99").mkdir()  # the store's: a save killed part-way
    (tmp_path / "base-dead.orbax-checkpoint-tmp-98").mkdir()
    store = CheckpointWeightStore(str(tmp_path), keep=1)
    store.save(-1, WEIGHTS, False, "e1")  # a LoRA base: earlier epochs' bases go
    for version in range(3):
        store.save(version, WEIGHTS, False, "e1")
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(theirs + ["LATEST", "base-e1", "v0000000002-e1"]), left
    assert (tmp_path / "venv" / "keep.txt").read_text() == "mine"
