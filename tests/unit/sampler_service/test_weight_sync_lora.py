"""A sampler under a LoRA trainer: the frozen base fetched once per trainer epoch, each adapters-only version merged
into it to the weights the trainer's own merge gives, in the sampler model's dtypes; and the base let go when the
trainer comes back without model.lora (a whole model's copy on the devices)."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.config.learning import LoraSection, ModelSection
from grpo_stream.common.model.lora import apply_lora
from grpo_stream.common.model.policy import build_model
from grpo_stream.common.model.sharding import make_mesh
from grpo_stream.common.weights.local_transport import LocalFetcher, LocalSink, LocalWeightHub
from grpo_stream.common.weights.snapshot import BASE_VERSION
from grpo_stream.sampler_service.weight_sync import WeightSync
from grpo_stream.trainer_service.publication.publisher import WeightPublisher


class CopyingFetcher(LocalFetcher):
    """The local transport, with each fetched array a copy of its own (as every transport between processes gives),
    and weak references to the arrays of the base fetches."""

    def __init__(self, hub):
        super().__init__(hub)
        self.base_arrays: list[weakref.ref] = []

    def fetch(self, manifest, targets):
        got = {name: jnp.array(x, copy=True) for name, x in super().fetch(manifest, targets).items()}
        if manifest.version == BASE_VERSION:
            self.base_arrays += [weakref.ref(x) for x in got.values()]
        return got


def lora_version(dtype: str):
    """(plain model, its LoRA policy, adapted params with B drawn at random so the merge is not the base)."""
    model = build_model(ModelSection(dtype=dtype), 64, seed=0)
    lora = apply_lora(model, model.params, LoraSection(rank=2, alpha=4.0), seed=1)
    rng = np.random.default_rng(0)
    named = {k: jnp.asarray(rng.normal(0, 0.05, v.shape)).astype(v.dtype) if k.endswith("_lora_b") else v
             for k, v in lora.adapted.named_arrays().items()}
    return model, lora, lora.adapted.params_from_arrays(named)


def sync_for(model, fetcher) -> WeightSync:
    return WeightSync(fetcher, model, make_mesh(1, 1, jax.devices()[:1], "sampler.mesh.tp"), "sampler-0")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_adapters_version_installs_the_trainers_merge_in_the_samplers_dtypes(dtype):
    model, lora, params = lora_version(dtype)
    hub = LocalWeightHub()
    publisher = WeightPublisher(LocalSink(hub), "local", epoch="e1")
    base, adapters = lora.split_named(params)
    publisher.publish_base(base)
    publisher.publish_arrays(0, adapters, adapters=lora.adapter_version())
    got = sync_for(model, CopyingFetcher(hub)).poll()
    want, have = model.named_arrays(lora.merged(params)), model.named_arrays(got.params)
    for name, x in want.items():
        assert have[name].dtype == model.named_arrays()[name].dtype, name  # what the engine was built for
        np.testing.assert_array_equal(np.asarray(have[name], np.float32), np.asarray(x, np.float32), err_msg=name)


def test_the_base_is_let_go_when_a_trainer_without_lora_takes_over():
    model, lora, params = lora_version("float32")
    hub = LocalWeightHub()
    publisher = WeightPublisher(LocalSink(hub), "local", epoch="e1")
    base, adapters = lora.split_named(params)
    publisher.publish_base(base)
    publisher.publish_arrays(0, adapters, adapters=lora.adapter_version())
    fetcher = CopyingFetcher(hub)
    sync = sync_for(model, fetcher)
    sync.mark_installed(sync.poll(), report=False)
    assert fetcher.base_arrays and all(ref() is not None for ref in fetcher.base_arrays)  # held for the next merge
    # the trainer restarts without model.lora: a new epoch of whole versions
    WeightPublisher(LocalSink(hub), "local", epoch="e2").publish_arrays(0, model.named_arrays(lora.merged(params)))
    got = sync.poll()
    sync.mark_installed(got, report=False)
    assert (got.version, got.epoch) == (0, "e2")
    del got
    gc.collect()
    assert all(ref() is None for ref in fetcher.base_arrays)  # no second copy of the model left on the devices
