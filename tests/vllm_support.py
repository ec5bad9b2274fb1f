"""The vLLM environment for the `vllm` tests, and the tiny Qwen2 model they run.

vLLM lives in its own environment (requirements/install-vllm-env.sh): the tests find its Python at
$GRPO_STREAM_VLLM_PYTHON or ROOT/.venv-vllm/bin/python. Without one they are skipped, except where
$GRPO_STREAM_REQUIRE_VLLM=1 (CI sets it), where a missing environment fails them.
"""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def vllm_python() -> str:
    path = pathlib.Path(os.environ.get("GRPO_STREAM_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not path.exists():
        why = (f"no vLLM environment at {path}: make one with `bash requirements/install-vllm-env.sh .venv-vllm cpu` "
               "or point GRPO_STREAM_VLLM_PYTHON at its python")
        if os.environ.get("GRPO_STREAM_REQUIRE_VLLM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return str(path)


def tiny_qwen2_dir(directory: pathlib.Path, tied: bool = True, seed: int = 0) -> pathlib.Path:
    """A Qwen2 checkpoint directory vLLM's CPU backend runs (head_dim 64; it refuses 16) with the arith task's
    tokenizer; random weights at the scale of a Hugging Face init, so its distributions are neither flat nor
    one-hot. Written by our own exporter: no torch needed."""
    from grpo_stream.common.model.architectures import Architecture
    from grpo_stream.common.model.hf_checkpoint import export_hf
    from grpo_stream.common.model.policy import build_from_architecture
    from grpo_stream.common.tasks.arith import ArithTask
    from grpo_stream.common.model.tokenizer import train_bpe

    tok = train_bpe(ArithTask(10, 99, 0.1, seed=0).corpus(4000), 160)
    tok.save(directory)
    arch = Architecture(family="qwen2", vocab_size=tok.vocab_size, num_layers=2, embed_dim=128, hidden_dim=256,
                        num_heads=2, num_kv_heads=1, head_dim=64, norm_eps=1e-6, rope_theta=1e6,
                        tied_embeddings=tied)
    named = build_from_architecture(arch, seed=seed).to_named_numpy()
    named = {k: v * 0.05 if "embed" in k else v for k, v in named.items()}
    export_hf(directory, arch, named, tokenizer_dir=directory, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
    return directory


def script_result(module: str, tmp_path: pathlib.Path, tied: bool = True) -> dict:
    """Run `python -m tests.vllm_scripts.<module> MODEL_DIR OUT.json` in the vLLM environment on a tiny Qwen2
    checkpoint (tied embeddings or not) and return the measurements it wrote; its stderr when it fails."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    model_dir = tiny_qwen2_dir(tmp_path / "model", tied=tied)
    out = tmp_path / "out.json"
    proc = subprocess.run([vllm_python(), "-m", f"tests.vllm_scripts.{module}", str(model_dir), str(out)],
                          cwd=pathlib.Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())
