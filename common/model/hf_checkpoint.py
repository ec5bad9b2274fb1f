"""Hugging Face checkpoint directories in and out: safetensors <-> the policy's named parameters.

Loading reads `config.json` (`grpo_stream.common.model.architectures`), every safetensors file
of the directory (the files `model.safetensors.index.json` names when there
is one, else `*.safetensors`), maps each tensor to our parameter name and
layout, converts it to the requested dtype (float32 or bfloat16), and places
it on the model's sharding (the default device, or a mesh). Nothing is
downloaded. Every problem names the tensor or field: a missing tensor, a
shape that disagrees with `config.json`, an unknown or duplicated tensor, a
dtype safetensors allows but we do not read.

Export writes the inverse: `model.safetensors` in HF names and [out, in]
layouts, `config.json`, and the tokenizer files, a directory `transformers`
(and so vLLM) loads.

The safetensors format is read and written here directly (an 8-byte header
length, a JSON header of name -> dtype, shape, byte offsets, then the raw
little-endian bytes) so bfloat16 maps onto `ml_dtypes.bfloat16` without a
framework in between, and files are memory-mapped.
"""

from __future__ import annotations

import json
import mmap
import pathlib
import re
import shutil
import struct
from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

from grpo_stream.common.model.architectures import Architecture, ArchitectureError, from_hf_config, to_hf_config

DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
          "F64": np.dtype(np.float64)}
_CODES = {v: k for k, v in DTYPES.items()}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded, with the file/tensor named."""


# ---- safetensors files ----------------------------------------------------------------------------------------

def read_safetensors(path: pathlib.Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of one file; arrays are views of a read-only memory map."""
    if path.stat().st_size < 8:
        raise CheckpointError(f"{path}: not a safetensors file (too short); the file is truncated")
    with open(path, "rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise CheckpointError(f"{path}: header length {header_len} exceeds the file; the file is truncated")
    try:
        header = json.loads(bytes(data[8:8 + header_len]))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: header is not JSON ({exc})") from None
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {info.get('dtype')}; readable dtypes: "
                                  f"{', '.join(DTYPES)}")
        dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
        start, end = info["data_offsets"]
        if end - start != dtype.itemsize * int(np.prod(shape)) or base + end > len(data):
            raise CheckpointError(f"{path}: tensor {name} has {end - start} bytes for shape {list(shape)} "
                                  f"{info['dtype']}, or runs past the end of the file; the file is corrupt")
        yield name, np.frombuffer(data, dtype, int(np.prod(shape)), base + start).reshape(shape)


def write_safetensors(path: pathlib.Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        if arr.dtype not in _CODES:
            raise ValueError(f"tensor {name}: dtype {arr.dtype} cannot be written")
        header[name] = {"dtype": _CODES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for arr in tensors.values():
            out.write(np.ascontiguousarray(arr).tobytes())


def checkpoint_files(directory: pathlib.Path) -> list[pathlib.Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (directory / n).exists()]
        if missing:
            raise CheckpointError(f"{index} names files that are not there: {missing}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files (and no model.safetensors.index.json)")
    return files


# ---- names and layouts ----------------------------------------------------------------------------------------

_PENDING_QKV = re.compile(r"\.attn\._[qkv]$")  # Gemma q/k/v read but not yet assembled


def _gemma_norms(arch: Architecture) -> dict[str, str]:
    """HF layer norm name -> Tunix module name (Gemma 2 and 3 name the post-attention norm differently)."""
    return {"input_layernorm": "pre_attention_norm",
            "post_attention_layernorm": "post_attn_norm" if arch.family == "gemma2" else "post_attention_norm",
            "pre_feedforward_layernorm": "pre_ffw_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def _gemma_rules(arch: Architecture) -> list:
    e, h, d = arch.embed_dim, arch.num_heads, arch.head_dim
    L = r"model\.layers\.(\d+)\."
    qk_norms = [(L + r"self_attn\.q_norm\.weight", "layers.{0}.attn._query_norm.scale", lambda w: w),
                (L + r"self_attn\.k_norm\.weight", "layers.{0}.attn._key_norm.scale", lambda w: w)]
    return [*(qk_norms if arch.family == "gemma3" else []),
        (r"model\.embed_tokens\.weight", "embedder.input_embedding", lambda w: w),
        (r"model\.norm\.weight", "final_norm.scale", lambda w: w),
        # q/k/v become Tunix's einsum tensors once all three are read (_assemble_gemma): [heads, embed, head_dim]
        (L + r"self_attn\.(q|k|v)_proj\.weight", "layers.{0}.attn._{1}", lambda w: w.reshape(-1, d, e).transpose(0, 2, 1)),
        (L + r"self_attn\.o_proj\.weight", "layers.{0}.attn.attn_vec_einsum.w", lambda w: w.T.reshape(h, d, e)),
        (L + r"mlp\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.{1}_proj.kernel", lambda w: w.T),
        *[(L + hf + r"\.weight", "layers.{0}." + ours + ".scale", lambda w: w) for hf, ours in _gemma_norms(arch).items()],
    ]


def _assemble_gemma(named: dict[str, np.ndarray], arch: Architecture) -> dict[str, np.ndarray]:
    """Per-layer q, k, v -> Tunix's qkv_einsum [3, N, E, H] (when heads == kv heads) or q_einsum + kv_einsum."""
    out = {k: v for k, v in named.items() if not _PENDING_QKV.search(k)}
    for i in range(arch.num_layers):
        parts = [named.get(f"layers.{i}.attn._{x}") for x in "qkv"]
        if any(p is None for p in parts):
            continue  # reported as missing parameters by the caller
        if arch.num_heads == arch.num_kv_heads:
            out[f"layers.{i}.attn.qkv_einsum.w"] = np.stack(parts)
        else:
            out[f"layers.{i}.attn.q_einsum.w"] = parts[0]
            out[f"layers.{i}.attn.kv_einsum.w"] = np.stack(parts[1:])
    return out


def _hf_rules(arch: Architecture) -> list[tuple[re.Pattern, Callable[[re.Match], str], Callable]]:
    """(HF name pattern, our name, HF array -> our layout) for every tensor of the family."""
    if arch.family in ("gemma2", "gemma3"):
        return [(re.compile(p + "$"), (lambda m, t=t: t.format(*m.groups())), f) for p, t, f in _gemma_rules(arch)]
    e, h, kv, d = arch.embed_dim, arch.num_heads, arch.num_kv_heads, arch.head_dim

    def attn(heads):
        return lambda w: w.T.reshape(e, heads, d)
    rules = [
        (r"model\.embed_tokens\.weight", "embedder.input_embedding", lambda w: w),
        (r"model\.norm\.weight", "final_norm.w", lambda w: w),
        (r"lm_head\.weight", "lm_head.w", lambda w: w.T),
        (r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", "layers.{0}.attn.q_proj.w", attn(h)),
        (r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", "layers.{0}.attn.k_proj.w", attn(kv)),
        (r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", "layers.{0}.attn.v_proj.w", attn(kv)),
        (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", "layers.{0}.attn.o_proj.w", lambda w: w.T.reshape(h, d, e)),
        (r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "layers.{0}.mlp.{1}_proj.kernel", lambda w: w.T),
        (r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight", "layers.{0}.{1}.w",
         lambda w: w),
    ]
    if arch.qk_norm:
        rules.append((r"model\.layers\.(\d+)\.self_attn\.(q|k)_norm\.weight", "layers.{0}.attn.{1}_norm.w",
                      lambda w: w))
    if arch.qkv_bias:
        rules.append((r"model\.layers\.(\d+)\.self_attn\.(q|k|v)_proj\.bias", "layers.{0}.attn.{1}_bias",
                      lambda w: w))
    return [(re.compile(p + "$"), (lambda m, t=t: t.format(*m.groups())), f) for p, t, f in rules]


def to_our_names(arch: Architecture, hf_name: str) -> tuple[str, Callable] | None:
    """Our name and the HF -> our layout function for an HF tensor; None for tensors with nothing to hold."""
    if "rotary_emb" in hf_name:
        return None
    if arch.tied_embeddings and hf_name == "lm_head.weight":
        return None  # tied: the head is the embedding; some exports still write a copy
    for pattern, name, layout in _hf_rules(arch):
        match = pattern.match(hf_name)
        if match:
            return name(match), layout
    raise CheckpointError(f"tensor {hf_name}: not part of a {arch.family} model as config.json describes it "
                          "(check model_type, tie_word_embeddings, attention_bias)")


def to_hf_names(arch: Architecture, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `to_our_names`: HF names and [out, in] layouts."""
    if arch.family in ("gemma2", "gemma3"):
        return _gemma_to_hf(arch, named)
    out = {}
    for name, w in named.items():
        parts = name.split(".")
        if name == "embedder.input_embedding":
            out["model.embed_tokens.weight"] = w
        elif name == "final_norm.w":
            out["model.norm.weight"] = w
        elif name == "lm_head.w":
            out["lm_head.weight"] = w.T
        elif parts[2] == "attn" and parts[3].endswith("_proj"):
            hf = f"model.layers.{parts[1]}.self_attn.{parts[3]}.weight"
            out[hf] = w.reshape(w.shape[0] * w.shape[1], -1).T if parts[3] == "o_proj" else w.reshape(w.shape[0], -1).T
        elif parts[2] == "attn" and parts[3].endswith("_norm"):
            out[f"model.layers.{parts[1]}.self_attn.{parts[3]}.weight"] = w
        elif parts[2] == "attn" and parts[3].endswith("_bias"):
            out[f"model.layers.{parts[1]}.self_attn.{parts[3][0]}_proj.bias"] = w
        elif parts[2] == "mlp":
            out[f"model.layers.{parts[1]}.mlp.{parts[3]}.weight"] = w.T
        elif parts[2] in ("input_layernorm", "post_attention_layernorm"):
            out[f"model.layers.{parts[1]}.{parts[2]}.weight"] = w
        else:
            raise ValueError(f"parameter {name} has no Hugging Face name for {arch.family}")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _gemma_to_hf(arch: Architecture, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out, e = {}, arch.embed_dim
    to_hf_norm = {v: k for k, v in _gemma_norms(arch).items()}
    for name, w in named.items():
        parts = name.split(".")
        if name == "embedder.input_embedding":
            out["model.embed_tokens.weight"] = w
        elif name == "final_norm.scale":
            out["model.norm.weight"] = w
        elif parts[2] == "attn":
            prefix = f"model.layers.{parts[1]}.self_attn."
            if parts[3] == "attn_vec_einsum":
                out[prefix + "o_proj.weight"] = w.reshape(-1, e).T
                continue
            if parts[3] in ("_query_norm", "_key_norm"):
                out[prefix + f"{parts[3][1]}_norm.weight"] = w
                continue
            stacked = {"q_einsum": ("q",), "kv_einsum": ("k", "v"), "qkv_einsum": ("q", "k", "v")}[parts[3]]
            tensors = [w] if parts[3] == "q_einsum" else list(w)
            for x, t in zip(stacked, tensors):  # [heads, embed, head_dim] -> [heads * head_dim, embed]
                out[prefix + f"{x}_proj.weight"] = t.transpose(0, 2, 1).reshape(-1, e)
        elif parts[2] == "mlp":
            out[f"model.layers.{parts[1]}.mlp.{parts[3]}.weight"] = w.T
        else:
            out[f"model.layers.{parts[1]}.{to_hf_norm[parts[2]]}.weight"] = w
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ---- directories ----------------------------------------------------------------------------------------------

HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]


def resolve_model_dir(path: str) -> pathlib.Path:
    """A local model directory for `model.path`: the directory itself, or a Hugging Face hub id (`org/name`)
    resolved through the local Hugging Face cache, downloading only where a network and permission exist
    (HF_HUB_OFFLINE=1 keeps it to the cache)."""
    local = pathlib.Path(path)
    if local.is_dir():
        return local
    if local.is_absolute() or path.startswith(".") or path.count("/") != 1:
        raise CheckpointError(f"model.path={path}: no such directory (and not a hub id like org/name)")
    from huggingface_hub import snapshot_download  # noqa: PLC0415
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError  # noqa: PLC0415

    try:
        return pathlib.Path(snapshot_download(repo_id=path, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as exc:
        raise CheckpointError(f"model.path={path}: not a local directory, and the hub/cache could not provide it "
                              f"({type(exc).__name__}: {exc})") from None


def read_architecture(directory: str | pathlib.Path) -> Architecture:
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json; point model.path at a Hugging Face model directory")
    try:
        return from_hf_config(json.loads(path.read_text()), str(path))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def read_named(directory: str | pathlib.Path, arch: Architecture, expected: dict[str, tuple],
               dtype: np.dtype) -> dict[str, np.ndarray]:
    """Our-named arrays in `dtype`, checked against `expected` (name -> shape): nothing missing, extra or misshapen."""
    directory = pathlib.Path(directory)
    named: dict[str, np.ndarray] = {}
    source: dict[str, pathlib.Path] = {}
    for path in checkpoint_files(directory):
        for hf_name, array in read_safetensors(path):
            mapped = to_our_names(arch, hf_name)
            if mapped is None:
                continue
            name, layout = mapped
            if name in named:
                raise CheckpointError(f"tensor {hf_name} appears in both {source[name].name} and {path.name}")
            if name not in expected and not _PENDING_QKV.search(name):
                raise CheckpointError(f"{path.name}: tensor {hf_name} has no place in the model config.json "
                                      f"describes (num_hidden_layers={arch.num_layers}?)")
            try:
                value = layout(array)
            except ValueError:  # a reshape that cannot work: the HF shape disagrees with config.json
                value = array
            if name in expected and tuple(value.shape) != tuple(expected[name]):
                raise CheckpointError(f"{path.name}: tensor {hf_name} has shape {list(array.shape)}; config.json "
                                      f"implies {list(expected[name])} in our layout for {name}")
            named[name], source[name] = value.astype(dtype, copy=False), path
    if arch.family in ("gemma2", "gemma3"):
        named = _assemble_gemma(named, arch)
        for name, value in named.items():
            if tuple(value.shape) != tuple(expected.get(name, value.shape)):
                raise CheckpointError(f"{directory}: {name} assembled to shape {list(value.shape)}; config.json "
                                      f"implies {list(expected[name])}")
    missing = sorted(set(expected) - set(named))
    if missing:
        raise CheckpointError(f"{directory}: tensors missing for {len(missing)} parameters, e.g. {missing[:3]} "
                              "(an incomplete download, or tie_word_embeddings wrong in config.json)")
    return named


def write_hf_config(directory: pathlib.Path, arch: Architecture, dtype: str = "float32",
                    eos_ids: list[int] | None = None, pad_id: int | None = None) -> dict:
    """`directory/config.json` for `arch`, with the run's stop and pad tokens; returns the config."""
    config = to_hf_config(arch, dtype)
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)
    if pad_id is not None:
        config["pad_token_id"] = pad_id
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def export_hf(directory: str | pathlib.Path, arch: Architecture, named: dict[str, np.ndarray],
              tokenizer_dir: str | pathlib.Path | None = None, dtype: str = "float32",
              eos_ids: list[int] | None = None, pad_id: int | None = None) -> pathlib.Path:
    """Write a Hugging Face model directory: model.safetensors, config.json and the tokenizer files.

    `eos_ids`/`pad_id` (the run's stop and pad tokens) go into config.json and, unless the source
    directory brought its own, a generation_config.json, so `generate` on the export stops where the
    run's sampler did.
    """
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}[dtype]
    tensors = {k: v.astype(np_dtype) for k, v in to_hf_names(arch, named).items()}
    write_safetensors(out / "model.safetensors", tensors)
    config = write_hf_config(out, arch, dtype, eos_ids, pad_id)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = pathlib.Path(tokenizer_dir) / name
            if src.exists() and src.resolve() != (out / name).resolve():
                shutil.copy(src, out / name)
    if eos_ids and not (out / "generation_config.json").exists():
        (out / "generation_config.json").write_text(json.dumps(
            {k: config[k] for k in ("eos_token_id", "pad_token_id") if k in config}, indent=2) + "\n")
    return out


__all__ = ["ArchitectureError", "CheckpointError", "checkpoint_files", "export_hf", "read_architecture", "read_named",
           "read_safetensors", "to_hf_names", "to_our_names", "write_hf_config", "write_safetensors"]
