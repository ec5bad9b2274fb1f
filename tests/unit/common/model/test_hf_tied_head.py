"""A checkpoint whose config.json ties the output head to the embedding but which also holds an lm_head.weight: a
copy equal to the embedding (some exports write one) loads; a different one is refused naming the tensor and the
field. transformers 5 then unties the model and computes with lm_head.weight (it warns "we will NOT tie them"), while
the head here is the embedding: loading it silently gave logits other than the checkpoint's in transformers."""

import numpy as np
import pytest

from grpo_stream.common.model.families import FAMILIES
from grpo_stream.common.model.hf_checkpoint import CheckpointError, read_safetensors, write_safetensors
from grpo_stream.common.model.policy import load_hf_model

from tests.unit.common.model.test_hf_checkpoint_shapes import write_checkpoint

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
TIED = [f for f in FAMILIES if f.tiny_hf_config.get("tie_word_embeddings", True)]


@pytest.mark.parametrize("record", TIED, ids=[f.family for f in TIED])
def test_a_head_copy_equal_to_the_embedding_loads_as_the_embedding(tmp_path, record):
    tensors = write_checkpoint(tmp_path, record)
    assert HEAD not in tensors  # what export writes for a tied model
    write_safetensors(tmp_path / "model.safetensors", {**tensors, HEAD: tensors[EMBED].copy()})
    model = load_hf_model(str(tmp_path))
    assert model.arch.tied_embeddings
    np.testing.assert_array_equal(model.to_named_numpy()["embedder.input_embedding"], tensors[EMBED])


@pytest.mark.parametrize("record", TIED, ids=[f.family for f in TIED])
def test_a_head_that_differs_from_the_embedding_it_is_tied_to_is_refused(tmp_path, record):
    tensors = write_checkpoint(tmp_path, record)
    head = tensors[EMBED].copy()
    head[-1, 0] += 1.0  # one value of the last row: the comparison looks at all of it
    write_safetensors(tmp_path / "model.safetensors", {**tensors, HEAD: head})
    with pytest.raises(CheckpointError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight.*"
                                              r"tie_word_embeddings=true"):
        load_hf_model(str(tmp_path))


def test_a_differing_head_in_another_shard_is_refused_too(tmp_path):
    record = TIED[0]
    tensors = write_checkpoint(tmp_path, record)
    (tmp_path / "model.safetensors").unlink()
    head = {HEAD: np.zeros_like(tensors[EMBED])}
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", head)  # the head read before the embedding
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", tensors)
    assert [name for name, _ in read_safetensors(tmp_path / "model-00001-of-00002.safetensors")] == [HEAD]
    with pytest.raises(CheckpointError, match=r"lm_head\.weight differs from model\.embed_tokens\.weight"):
        load_hf_model(str(tmp_path))


def test_transformers_computes_with_a_differing_head_copy_the_reason_it_is_refused(tmp_path):
    """The premise: transformers leaves such a model untied, its head the checkpoint's lm_head.weight."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tensors = write_checkpoint(tmp_path, TIED[0])
    head = np.random.default_rng(1).normal(size=tensors[EMBED].shape).astype(np.float32)
    write_safetensors(tmp_path / "model.safetensors", {**tensors, HEAD: head})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    np.testing.assert_array_equal(theirs.lm_head.weight.detach().numpy(), head)
    assert not torch.equal(theirs.lm_head.weight, theirs.model.embed_tokens.weight)
