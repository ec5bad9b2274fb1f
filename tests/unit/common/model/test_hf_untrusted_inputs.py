"""A checkpoint directory from an untrusted party: a malformed config.json or index is refused with the field or file
named (not a traceback), an index cannot point outside the directory, and RoPE settings given twice are read the way
transformers reads them (else the logits would silently differ from transformers' and vLLM's)."""

import json

import numpy as np
import pytest

from grpo_stream.common.model.architectures import ArchitectureError, from_hf_config
from grpo_stream.common.model.families import GEMMA3, LLAMA3, QWEN2
from grpo_stream.common.model.hf_checkpoint import CheckpointError, checkpoint_files, write_safetensors


def _shard(directory, name="model-00001-of-00001.safetensors"):
    write_safetensors(directory / name, {"model.norm.weight": np.ones(4, np.float32)})
    return name


@pytest.mark.parametrize("shard", ["../outside/x.safetensors", "ABSOLUTE", "sub/../../outside/x.safetensors", ".."])
def test_an_index_cannot_name_files_outside_the_checkpoint(tmp_path, shard):
    outside, checkpoint = tmp_path / "outside", tmp_path / "ckpt"
    outside.mkdir(), checkpoint.mkdir()
    _shard(outside, "x.safetensors")  # exists: before, it was loaded as part of the model
    shard = str(outside / "x.safetensors") if shard == "ABSOLUTE" else shard
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    with pytest.raises(CheckpointError, match="shards must be file names in the checkpoint's own directory"):
        checkpoint_files(checkpoint)


@pytest.mark.parametrize("text", ["{nope", "[]", "{}", '{"weight_map": []}', '{"weight_map": {"a": 5}}'])
def test_a_malformed_index_is_named(tmp_path, text):
    _shard(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        checkpoint_files(tmp_path)


def test_a_well_formed_index_still_lists_its_shards(tmp_path):
    name = _shard(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": name}}))
    assert checkpoint_files(tmp_path) == [tmp_path / name]


@pytest.mark.parametrize("record, edit, message", [
    (QWEN2, None, "not a JSON object of model settings; it is a list"),
    (QWEN2, {"model_type": ["qwen2"]}, "field 'model_type'=\\['qwen2'\\] is not a string"),
    # int() would have truncated, parsed or counted these; transformers refuses them
    (QWEN2, {"hidden_size": 64.7}, "field 'hidden_size'=64.7 is not a positive integer"),
    (QWEN2, {"hidden_size": "64"}, "field 'hidden_size'='64' is not a positive integer"),
    (QWEN2, {"num_hidden_layers": True}, "field 'num_hidden_layers'=True is not a positive integer"),
    (QWEN2, {"num_hidden_layers": -1}, "field 'num_hidden_layers'=-1 is not a positive integer"),
    (QWEN2, {"vocab_size": 0}, "field 'vocab_size'=0 is not a positive integer"),
    # bool("false") is True: an untied model tied, its lm_head.weight dropped unsaid
    (LLAMA3, {"tie_word_embeddings": "false"}, "field 'tie_word_embeddings'='false' is not a JSON boolean"),
    (GEMMA3, {"tie_word_embeddings": 0}, "field 'tie_word_embeddings'=0 is not a JSON boolean"),
    (GEMMA3, {"num_attention_heads": 0}, "field 'num_attention_heads'=0 is not a positive integer"),
    (QWEN2, {"rope_theta": "abc"}, "field 'rope_theta'='abc' is not a float"),
    (QWEN2, {"rope_scaling": "linear"}, "field 'rope_scaling'='linear' is not a JSON object"),
    (QWEN2, {"rope_parameters": [1]}, "field 'rope_parameters'=\\[1\\] is not a JSON object"),
    (LLAMA3, {"rope_scaling": {**LLAMA3.tiny_hf_config["rope_scaling"], "factor": "x"}},
     "rope_scaling: field 'factor'='x' is not a float"),
    (GEMMA3, {"sliding_window_pattern": "x"}, "a gemma3_text field has an unusable value"),
])
def test_config_values_of_the_wrong_type_are_named(record, edit, message):
    config = [1] if edit is None else {**record.tiny_hf_config, **edit}
    with pytest.raises(ArchitectureError, match=message):
        from_hf_config(config, "config.json")


def test_gemma3_rope_scaling_updates_the_full_layers_rope_as_in_transformers():
    """Gemma3TextConfig updates rope_parameters' full_attention entry with an (older) rope_scaling; reading
    rope_parameters alone ran a yarn-scaled model without the scaling, or with another linear factor."""
    base = dict(GEMMA3.tiny_hf_config)  # rope_parameters: full_attention linear, factor 8
    with pytest.raises(ArchitectureError, match="rope type 'yarn'"):
        from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert from_hf_config({**base, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}).rope_linear_factor == 2.0
    assert from_hf_config(base).rope_linear_factor == 8.0


def test_rope_parameters_base_wins_over_the_top_level_one_as_in_transformers():
    config = {**QWEN2.tiny_hf_config, "rope_theta": 10000.0,
              "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert from_hf_config(config).rope_theta == 500000.0
    # an older config's rope_scaling takes rope_parameters' place (transformers then ignores the latter)
    assert from_hf_config({**config, "rope_scaling": {"rope_type": "default"}}).rope_theta == 10000.0


def test_a_config_of_more_layers_than_the_checkpoint_holds_is_refused_before_the_model_is_built(tmp_path):
    """A config.json of a million layers beside a small checkpoint built the model's shapes for hours before any
    tensor was compared (55 s for 200 layers); the layer count is read from the tensors' headers first."""
    from grpo_stream.common.model.policy import load_hf_model
    from tests.vllm_support import tiny_qwen2_dir

    directory = tiny_qwen2_dir(tmp_path / "model")
    config = json.loads((directory / "config.json").read_text())
    layers = config["num_hidden_layers"]
    (directory / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers + 30}))
    with pytest.raises(CheckpointError, match=f"num_hidden_layers={layers + 30}, but the checkpoint's tensors hold "
                                              f"{layers} layers"):
        load_hf_model(str(directory), "float32")
    (directory / "config.json").write_text(json.dumps(config))
    assert load_hf_model(str(directory), "float32").arch.num_layers == layers
