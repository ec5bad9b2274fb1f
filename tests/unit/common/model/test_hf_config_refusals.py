"""config.json fields that change what transformers computes are read or refused, never ignored: a config the model
code cannot follow is refused with the field named (each case below loaded silently and gave logits up to 0.7 away
from transformers'), and a field written as null means what transformers makes of it."""

import pytest

from grpo_stream.common.model.architectures import ArchitectureError, from_hf_config
from grpo_stream.common.model.families import FAMILIES, GEMMA2, GEMMA3, LLAMA3, QWEN2

_SLIDING_GEMMA2 = ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("record, edit, message", [
    # transformers applies Gemma 2's rope_parameters (linear, dynamic, ...); Tunix's Gemma 2 code has no scaling
    (GEMMA2, {"rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}},
     "rope_type='linear'; Tunix's Gemma 2 code fixes it to 'default'"),
    (GEMMA2, {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_type='dynamic'; Tunix's Gemma 2 code fixes it to 'default'"),
    # Gemma 3 text with bidirectional attention (EmbeddingGemma): every token sees the ones after it
    (GEMMA3, {"use_bidirectional_attention": True},
     "use_bidirectional_attention=True; Tunix's Gemma 3 code supports only"),
    # sliding layers without a window: transformers cannot run it, Tunix failed with a message naming no field
    (GEMMA2, {"sliding_window": None, "layer_types": _SLIDING_GEMMA2},
     "sliding_window=None; the sliding_attention layers need a window"),
    (GEMMA3, {"sliding_window": None}, "sliding_window=None; the sliding_attention layers need a window"),
    # transformers' default (sdpa) Gemma 2 attention is then bidirectional: logits up to 0.5 away
    (GEMMA2, {"use_bidirectional_attention": True}, "use_bidirectional_attention=True; Tunix's Gemma 2 code fixes"),
    # q/k/v/o biases Tunix's Gemma code has no weights for: refused by config.json's field, not by a tensor's name
    (GEMMA2, {"attention_bias": True}, "attention_bias=True; Tunix's Gemma 2 code fixes it to False"),
    (GEMMA3, {"attention_bias": True}, "attention_bias=True; Tunix's Gemma 3 code supports only"),
])
def test_configs_our_model_code_would_compute_differently_are_refused(record, edit, message):
    config = {**record.tiny_hf_config, **edit}
    if "layer_types" in edit:
        config["num_hidden_layers"] = len(edit["layer_types"])
    with pytest.raises(ArchitectureError, match=message):
        from_hf_config(config, "config.json")


def test_the_refused_fields_at_their_defaults_still_load():
    assert from_hf_config({**GEMMA2.tiny_hf_config, "rope_parameters": {"rope_type": "default",
                                                                        "rope_theta": 10000.0}}).family == "gemma2"
    assert from_hf_config({**GEMMA3.tiny_hf_config, "use_bidirectional_attention": False}).family == "gemma3"
    full_only = {**GEMMA2.tiny_hf_config, "sliding_window": None, "num_hidden_layers": 2,
                 "layer_types": ["full_attention"] * 2}
    assert from_hf_config(full_only).sliding_window is None  # no sliding layer: no window needed


@pytest.mark.parametrize("record", [LLAMA3, QWEN2])
def test_fields_written_as_null_take_transformers_defaults(record):
    """LlamaConfig/Qwen2Config: head_dim null is hidden_size / num_attention_heads, num_key_value_heads null is
    num_attention_heads (multi-head attention), as when the field is absent."""
    config = {**record.tiny_hf_config, "head_dim": None, "num_key_value_heads": None}
    arch = from_hf_config(config, "config.json")
    heads = config["num_attention_heads"]
    assert (arch.head_dim, arch.num_kv_heads) == (config["hidden_size"] // heads, heads)
    with pytest.raises(ArchitectureError, match="field 'hidden_size' is missing"):  # no default: still missing
        from_hf_config({**config, "hidden_size": None}, "config.json")


@pytest.mark.parametrize("record", FAMILIES, ids=[f.family for f in FAMILIES])
def test_a_config_without_head_dim_takes_the_head_dim_transformers_gives_it(record):
    """Qwen3Config's default is 128 and Gemma's 256, not hidden_size / num_attention_heads (Qwen3's was read as 16
    here, and its checkpoint then refused as not matching its own config.json)."""
    transformers = pytest.importorskip("transformers")
    config = {k: v for k, v in record.tiny_hf_config.items() if k not in ("head_dim", "query_pre_attn_scalar")}
    theirs = transformers.AutoConfig.for_model(**config)
    want = getattr(theirs, "head_dim", None) or config["hidden_size"] // config["num_attention_heads"]
    assert from_hf_config(config, "config.json").head_dim == want


@pytest.mark.parametrize("record", FAMILIES, ids=[f.family for f in FAMILIES])
def test_kv_heads_that_do_not_divide_the_query_heads_are_refused_naming_the_field(record):
    """Gemma's parsed, and its model then failed in a reshape naming no field."""
    config = {**record.tiny_hf_config, "num_attention_heads": 4, "num_key_value_heads": 3}
    with pytest.raises(ArchitectureError, match="num_key_value_heads=3 must divide num_attention_heads=4"):
        from_hf_config(config, "config.json")
