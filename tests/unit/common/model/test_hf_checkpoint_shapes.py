"""A checkpoint's tensor shapes are checked as stored, in Hugging Face's [out, in] layout, before they are laid out
as our parameters: a tensor stored transposed ([in, out], as JAX/Flax exports store kernels) is refused by name,
for every family, rather than reshaped into scrambled weights."""

import jax
import numpy as np
import pytest

from grpo_stream.common.model import architectures
from grpo_stream.common.model.families import FAMILIES, gemma
from grpo_stream.common.model.hf_checkpoint import CheckpointError, export_hf, read_safetensors, write_safetensors
from grpo_stream.common.model.policy import build_from_architecture, load_hf_model

K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def write_checkpoint(directory, record) -> dict[str, np.ndarray]:
    """The record's tiny model with random weights as an HF directory; returns its tensors by HF name."""
    arch = architectures.from_hf_config(dict(record.tiny_hf_config), f"{record.family} tiny config")
    abstract = build_from_architecture(arch, seed=None)
    rng = np.random.default_rng(0)
    named = {n: rng.normal(size=leaf.shape).astype(np.float32)
             for n, leaf in zip(abstract.names(), jax.tree_util.tree_leaves(abstract.params))}
    export_hf(directory, arch, named)
    return {k: np.array(v) for k, v in read_safetensors(directory / "model.safetensors")}


def rewrite(directory, tensors, name, value) -> None:
    write_safetensors(directory / "model.safetensors", {**tensors, name: np.ascontiguousarray(value)})


@pytest.mark.parametrize("record", FAMILIES, ids=[f.family for f in FAMILIES])
def test_a_projection_stored_transposed_is_refused_by_name(tmp_path, record):
    tensors = write_checkpoint(tmp_path, record)
    assert tensors[K_PROJ].shape == (32, 64)  # 2 KV heads x 16 -> hidden 64: the reshape alone would accept [64, 32]
    rewrite(tmp_path, tensors, K_PROJ, tensors[K_PROJ].T)
    with pytest.raises(CheckpointError, match=rf"tensor {K_PROJ} has shape \[64, 32\]; config\.json implies \[32, 64\] "
                                              r"in Hugging Face's \[out, in\] layout: the tensor is stored transposed"):
        load_hf_model(str(tmp_path))


def test_a_transposed_mlp_tensor_names_both_shapes_as_stored(tmp_path):
    record = FAMILIES[0]
    tensors = write_checkpoint(tmp_path, record)
    gate = "model.layers.1.mlp.gate_proj.weight"
    rewrite(tmp_path, tensors, gate, tensors[gate].T)
    with pytest.raises(CheckpointError, match=rf"{gate} has shape \[64, 128\]; config\.json implies \[128, 64\] .*"
                                              "stored transposed"):
        load_hf_model(str(tmp_path))


@pytest.mark.parametrize("record", FAMILIES, ids=[f.family for f in FAMILIES])
def test_a_shape_config_json_does_not_describe_names_the_config(tmp_path, record):
    tensors = write_checkpoint(tmp_path, record)
    rewrite(tmp_path, tensors, K_PROJ, np.concatenate([tensors[K_PROJ]] * 2))  # 4 KV heads, config.json says 2
    with pytest.raises(CheckpointError, match=rf"{K_PROJ} has shape \[64, 64\]; config\.json implies \[32, 64\] .*"
                                              "config.json does not describe this checkpoint"):
        load_hf_model(str(tmp_path))


def test_gemma_q_k_v_that_cannot_be_stacked_are_named():
    """assemble's own check (read_named's shape check comes first; a caller handing it parts is told which)."""
    arch = architectures.from_hf_config({**dict(FAMILIES[-1].tiny_hf_config), "num_key_value_heads": 4})
    parts = {"layers.0.attn._q": np.zeros((4, 64, 16)), "layers.0.attn._k": np.zeros((4, 64, 16)),
             "layers.0.attn._v": np.zeros((2, 64, 16))}
    with pytest.raises(ValueError, match=r"layer 0: q/k/v projections disagree .*v_proj\.weight \[2, 64, 16\]"):
        gemma.assemble(parts, arch)
