"""Where parameters sit on a mesh (common/model/sharding.py): every family's matrices split over fsdp and tp as Tunix
annotates them; a mesh axis that does not divide a dimension keeps those parameters whole, and the log names the
setting and what it costs (on a 70B model an fsdp that divides no hidden size leaves every device the whole model);
the single-controller device split never overlaps fractions that sum to at most 1.0. Abstract meshes: no devices."""

import logging
import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh

from grpo_stream.common.model.architectures import Architecture, from_hf_config
from grpo_stream.common.model.families import FAMILIES
from grpo_stream.common.model.policy import build_from_architecture
from grpo_stream.common.model.sharding import param_shardings, split_devices

# Llama 3.1 8B's shapes (hidden size 4096), abstract: nothing allocated
LLAMA_8B = Architecture(family="llama3", vocab_size=128256, num_layers=2, embed_dim=4096, hidden_dim=14336,
                        num_heads=32, num_kv_heads=8, head_dim=128, norm_eps=1e-5, rope_theta=500000.0,
                        tied_embeddings=False)


def mesh(fsdp: int, tp: int) -> AbstractMesh:
    return AbstractMesh((fsdp, tp), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def per_device_bytes(params, shardings) -> int:
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))


@pytest.mark.parametrize("record", FAMILIES, ids=[f.family for f in FAMILIES])
def test_every_matrix_of_every_family_is_split_over_fsdp_and_tp(record):
    model = build_from_architecture(from_hf_config(dict(record.tiny_hf_config)), None)
    shardings = param_shardings(model.params, mesh(2, 2))
    for name, leaf, s in zip(model.names(), jax.tree.leaves(model.params), jax.tree.leaves(shardings)):
        axes = {a for dim in s.spec for a in ((dim,) if isinstance(dim, str) else dim or ())}
        if len(leaf.shape) >= 2:  # the tiny configs' shapes divide 2 everywhere: both axes in use
            assert axes == {"fsdp", "tp"}, (name, s.spec)


def test_an_fsdp_that_divides_no_hidden_size_is_a_warning_naming_the_setting(caplog):
    model = build_from_architecture(LLAMA_8B, None, jnp.bfloat16)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    with caplog.at_level(logging.INFO, logger="grpo_stream.common.model.sharding"):
        divides = param_shardings(model.params, mesh(8, 1))
        assert not caplog.records
        whole = param_shardings(model.params, mesh(6, 1))
    assert per_device_bytes(model.params, divides) < total / 7
    assert per_device_bytes(model.params, whole) > 0.99 * total  # every device holds the whole model
    warning, = caplog.records
    assert warning.levelno == logging.WARNING
    assert "trainer.mesh.fsdp=6 does not divide dimension(s) 4096" in warning.getMessage()
    assert "choose a size dividing 4096" in warning.getMessage()


def test_kv_heads_fewer_than_tp_are_replicated_with_a_note_not_a_warning(caplog):
    model = build_from_architecture(LLAMA_8B, None, jnp.bfloat16)
    with caplog.at_level(logging.INFO, logger="grpo_stream.common.model.sharding"):
        shardings = param_shardings(model.params, mesh(1, 16))  # 8 KV heads on tp=16: k and v kept whole over tp
    named = dict(zip(model.names(), jax.tree.leaves(shardings)))
    assert named["layers.0.attn.k_proj.w"].spec[1] is None and named["layers.0.attn.q_proj.w"].spec[1] == "tp"
    note, = caplog.records
    assert note.levelno == logging.INFO and "tp=16 does not divide dimension(s) 8" in note.getMessage()


@pytest.mark.parametrize("devices, fractions, split", [
    (3, (0.5, 0.5), (2, 1)),  # both round up: the samplers' share gives one back
    (5, (0.3, 0.7), (2, 3)),
    (2, (0.9, 0.1), (1, 1)),
    (8, (0.5, 0.5), (4, 4)),
    (8, (1.0, 1.0), (8, 8)),  # one shared mesh
])
def test_fractions_summing_to_at_most_one_split_the_devices_without_overlap(devices, fractions, split):
    trainer, samplers = split_devices(list(range(devices)), *fractions)
    assert (len(trainer), len(samplers)) == split
    assert fractions == (1.0, 1.0) or not set(trainer) & set(samplers)


def test_a_split_that_cannot_be_made_says_why():
    with pytest.raises(ValueError, match=r"1 device\(s\) cannot be split .* set both to 1.0"):
        split_devices([0], 0.5, 0.5)
    with pytest.raises(ValueError, match="take 5 \\+ 5 of 8 devices; make them sum to at most 1.0"):
        split_devices(list(range(8)), 0.6, 0.6)
