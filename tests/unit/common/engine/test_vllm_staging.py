"""The vLLM engine's staged versions (sampler.vllm.weight_install=files): a version whose safetensors write is cut
short (a full /dev/shm) leaves no part of itself in sampler.vllm.stage_dir. No vLLM needed: the write fails before
vLLM is reached; a staged install that reaches the workers: test_vllm_engine.py (mode files)."""

import errno

import pytest

from grpo_stream.common.engine import vllm_engine
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.policy import build_from_architecture


def test_a_version_whose_write_fails_leaves_nothing_in_the_stage_dir(tmp_path, monkeypatch):
    arch = Architecture(family="qwen2", vocab_size=64, num_layers=1, embed_dim=16, hidden_dim=32, num_heads=2,
                        num_kv_heads=1, head_dim=8, norm_eps=1e-6, rope_theta=1e4, tied_embeddings=True)
    model = build_from_architecture(arch, seed=0)

    def write_half(path, tensors):  # the filesystem fills up half-way through the file
        path.write_bytes(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(vllm_engine, "write_safetensors", write_half)
    # the engine as __init__ leaves it for weight_install=files; its vLLM is never reached
    engine = vllm_engine.VllmEngine.__new__(vllm_engine.VllmEngine)
    engine.model, engine.install_mode, engine.install_seconds = model, "files", []
    engine._stage_root = tmp_path / "grpo-vllm-stage"
    with pytest.raises(OSError, match="No space left"):
        engine._load_torch_weights(model.params)
    assert list(engine._stage_root.iterdir()) == []  # each restart's attempt would otherwise keep a partial version
