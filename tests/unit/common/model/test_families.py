"""Every registered model family (common/model/families/) x every feature its record declares: config.json mapping,
parameter names both ways, the sampler's decode layout, rematerialisation, activation sharding, vLLM and vLLM-TPU.

Each test is parametrized over `FAMILIES`, and each builds the family's tiny random-init model from the record's own
`tiny_hf_config`, so a new record is covered by all of them without editing this file. A feature a family lacks must
be declared `Unsupported` with a reason, and the tests check that the operator then gets that reason.
"""

import importlib
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_stream.common.engine import decode, vllm_tpu
from grpo_stream.common.model import architectures, hf_checkpoint
from grpo_stream.common.model.families import (FAMILIES, REGISTRY, RematSupport, Unsupported, VllmSupport,
                                               VllmTpuSupport, family_for_hf_config)
from grpo_stream.common.model.policy import build_from_architecture, causal_mask, positions_from_mask, remat_config
from grpo_stream.common.model.policy import sequence_logprobs
from tests.support import child_report

NAMES = [f.family for f in FAMILIES]
_MODELS: dict = {}


def tiny(record):
    """(arch, random-init float32 model) of the record's tiny config, built once per family."""
    if record.family not in _MODELS:
        arch = architectures.from_hf_config(dict(record.tiny_hf_config), f"{record.family} tiny config")
        _MODELS[record.family] = arch, build_from_architecture(arch, seed=3)
    return _MODELS[record.family]


@pytest.fixture(params=FAMILIES, ids=NAMES)
def record(request):
    return request.param


def test_the_registry_finds_every_family_by_its_hf_architectures_name(record):
    assert REGISTRY[record.hf_architecture] is record
    assert family_for_hf_config(dict(record.tiny_hf_config)) is record
    assert family_for_hf_config({"architectures": [record.hf_architecture]}) is record  # no model_type


def test_hf_config_maps_to_a_valid_model_config_and_back(record):
    arch, _ = tiny(record)
    assert arch.family == record.family
    config = architectures.tunix_config(arch)
    assert type(config).__module__ == record.tunix_module
    assert architectures.module_class(arch).__name__ == record.tunix_class
    exported = architectures.to_hf_config(arch)
    assert exported["architectures"] == [record.hf_architecture] and exported["model_type"] == record.hf_model_type
    assert architectures.from_hf_config(json.loads(json.dumps(exported))) == arch  # export, as a file, reads back


def test_parameter_names_round_trip_through_a_hugging_face_directory(record, tmp_path):
    """internal -> HF (export: config.json + safetensors) -> internal, exactly, for a random-init model."""
    arch, model = tiny(record)
    named = model.to_named_numpy()
    hf_checkpoint.export_hf(tmp_path, arch, named)
    assert hf_checkpoint.read_architecture(tmp_path) == arch
    shapes = {n: tuple(a.shape) for n, a in named.items()}
    back = hf_checkpoint.read_named(tmp_path, arch, shapes, np.dtype(np.float32))
    assert sorted(back) == sorted(named)
    for name, value in named.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_hf_names_are_the_names_transformers_gives_the_family(record):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    arch, model = tiny(record)
    config = transformers.AutoConfig.for_model(**architectures.to_hf_config(arch))
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config)
    assert type(theirs).__name__ == record.hf_architecture
    expected = {n for n in theirs.state_dict() if not (arch.tied_embeddings and n == "lm_head.weight")}
    ours = hf_checkpoint.to_hf_names(arch, model.to_named_numpy())
    assert set(ours) == expected
    assert all(tuple(ours[n].shape) == tuple(theirs.state_dict()[n].shape) for n in ours)


def test_decode_weights_give_the_training_forward_logits(record):
    """The sampler's re-laid weights (DecodeSpec) and the trainer's Tunix module (with the family's Tunix patches)
    compute the same function: prefill logits agree to float32 rounding."""
    arch, model = tiny(record)
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, arch.vocab_size, (2, 12)), jnp.int32)
    valid = jnp.ones(tokens.shape, jnp.bool_)
    positions, mask = positions_from_mask(valid), causal_mask(valid)
    want, _ = model.apply(model.params, tokens, positions, None, mask)
    weights = decode.decode_weights(model, model.params)
    got, _ = decode.forward(model, weights, tokens, positions, decode.init_cache(model, 2, 12), 0, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)


def test_tunix_patch_hooks_name_attributes_the_pinned_tunix_has(record):
    module = importlib.import_module(record.tunix_module)
    patches = record.tunix_patches
    assert not patches.rope or callable(module.apply_rope)
    assert not patches.remat_policy or hasattr(module, "nnx")
    for name in patches.shard_modules:
        assert callable(importlib.import_module(name).shard), name


@pytest.mark.heavy  # ~30 s of compiles; test_remat.py checks remat in the default lane
def test_remat_rules_apply_or_the_family_is_refused_with_its_reason(record):
    arch, model = tiny(record)
    if isinstance(record.remat, Unsupported):
        with pytest.raises(ValueError, match=f"the {record.family} model has no rematerialisation switch"):
            remat_config(arch, model.config, "full")
        return
    assert isinstance(record.remat, RematSupport)
    tokens = jnp.asarray(np.random.default_rng(1).integers(1, arch.vocab_size, (2, 10)), jnp.int32)
    valid = jnp.ones(tokens.shape, jnp.bool_)

    def grads(m):
        fn = lambda p: sequence_logprobs(m, p, tokens, valid, 1.0, 0).sum()  # noqa: E731
        return jax.jit(jax.grad(fn))(model.params), str(jax.make_jaxpr(jax.grad(fn))(model.params))

    plain, _ = grads(model)
    for mode in record.remat.members:
        remat, program = grads(model.with_remat(mode))
        assert "remat" in program and (("DotsSaveable" in program) == (mode == "save_dots")), mode
        # equal up to float rounding (recomputation fuses differently): within 1e-5 of the gradient's global norm
        diff = optax.global_norm(jax.tree.map(lambda x, y: x - y, plain, remat))
        assert float(diff) <= 1e-5 * float(optax.global_norm(plain)), mode


@pytest.fixture(scope="module")
def sharding_report() -> dict:
    return child_report("tests.unit.common.model.families_child", 2)


@pytest.mark.heavy  # a process of its own on a fake mesh; test_activation_sharding.py is in the default lane
def test_activation_sharding_reaches_the_family_model_code(record, sharding_report):
    """On an fsdp=2 mesh of fake CPU devices: outside the block Tunix's shard() does nothing; inside, the model's own
    constraints (hidden states, heads, MLP of every layer) are in the program, not only the logits'."""
    arch, _ = tiny(record)
    counts = sharding_report[record.family]
    assert counts["plain"] == 0
    assert counts["constrained"] >= 1 + 2 * arch.num_layers, counts


def test_vllm_names_the_class_the_export_declares(record):
    arch, _ = tiny(record)
    if isinstance(record.vllm, Unsupported):
        assert record.vllm.reason
        return
    assert isinstance(record.vllm, VllmSupport)
    assert architectures.to_hf_config(arch)["architectures"] == [record.vllm.architecture]


def test_vllm_tpu_maps_every_parameter_or_is_refused_with_its_reason(record):
    arch, model = tiny(record)
    if isinstance(record.vllm_tpu, Unsupported):
        with pytest.raises(vllm_tpu.VllmTpuWeightError, match=re.escape(record.vllm_tpu.reason)):
            vllm_tpu.family_mapping(record.family)
        assert record.family not in vllm_tpu.FAMILIES
        return
    assert isinstance(record.vllm_tpu, VllmTpuSupport) and record.family in vllm_tpu.FAMILIES
    targets, unknown = vllm_tpu.map_names(model.names(), record.family)
    assert unknown == []
    assert len({t.target for t in targets}) == len(targets) == len(model.names())  # one engine leaf per weight
