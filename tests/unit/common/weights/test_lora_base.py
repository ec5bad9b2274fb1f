"""LoRA's frozen base in the transports that hold versions themselves: beside the versions, never the latest,
never pruned by them, replaced per trainer epoch."""

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.weights.checkpoint_store import CheckpointWeightStore
from grpo_stream.common.weights.local_transport import LocalWeightHub
from grpo_stream.common.weights.snapshot import BASE_VERSION


def test_the_base_survives_pruning_and_only_the_newest_epochs_base_is_kept(tmp_path):
    store = CheckpointWeightStore(str(tmp_path), keep=2)
    base = {"w": jnp.arange(6.0).reshape(2, 3)}
    first = store.save(BASE_VERSION, base, False, "epoch1")
    assert store.latest() is None  # a base alone is no version to install
    for version in range(5):
        store.save(version, {"w_lora_a": jnp.full((2, 1), float(version))}, False, "epoch1")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["LATEST", "base-epoch1", "v0000000003-epoch1", "v0000000004-epoch1"]
    assert store.latest()["version"] == 4
    target = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(
        jax.devices()[0]))}
    np.testing.assert_array_equal(store.restore(first, target)["w"], base["w"])
    store.save(BASE_VERSION, base, False, "epoch2")  # a restarted trainer: the old epoch's base goes
    assert not (tmp_path / "base-epoch1").exists() and (tmp_path / "base-epoch2").exists()


def test_the_local_hubs_base_is_held_beside_the_latest_version():
    hub = LocalWeightHub()
    hub.publish(BASE_VERSION, {"w": jnp.ones(3)}, False, "e")
    assert hub.latest() is None and hub.base().version == BASE_VERSION
    hub.publish(0, {"w_lora_a": jnp.zeros(1)}, False, "e")
    assert hub.latest().version == 0 and set(hub.base().named) == {"w"}
