"""The `config.json` shapes of the checkpoints the shipped presets name, so `grpo-stream plan` can size a run
before the weights are on disk. Values are those of the models' published Hugging Face `config.json` files
(only the fields `architectures.from_hf_config` reads)."""

from __future__ import annotations

import pathlib

from grpo_stream.common.model.architectures import Architecture, from_hf_config

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_LLAMA32_ROPE = dict(_LLAMA31_ROPE, factor=32.0)
_LLAMA = {"model_type": "llama", "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "max_position_embeddings": 131072, "hidden_act": "silu"}
_QWEN25 = {"model_type": "qwen2", "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "max_position_embeddings": 32768, "hidden_act": "silu", "use_sliding_window": False}

KNOWN_CONFIGS: dict[str, dict] = {
    "llama-3.1-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "rope_scaling": _LLAMA31_ROPE},
    "llama-3.1-70b": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "rope_scaling": _LLAMA31_ROPE},
    "llama-3.2-1b": {**_LLAMA, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "tie_word_embeddings": True, "rope_scaling": _LLAMA32_ROPE},
    "qwen2.5-0.5b": {**_QWEN25, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2.5-1.5b": {**_QWEN25, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2.5-7b": {**_QWEN25, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
                   "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4},
}


def known_architecture(path_or_name: str) -> Architecture | None:
    """The architecture of a known checkpoint named by `path_or_name` (a directory or hub id whose last part is,
    e.g., Llama-3.1-8B-Instruct; the -Instruct suffix and case are ignored), or None."""
    name = pathlib.PurePosixPath(path_or_name.rstrip("/")).name.lower().removesuffix("-instruct")
    config = KNOWN_CONFIGS.get(name)
    return from_hf_config(config, f"known config of {name}") if config else None
