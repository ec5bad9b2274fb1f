"""Hugging Face checkpoint directories in and out: safetensors <-> the policy's named parameters.

Loading reads `config.json` (`grpo_stream.common.model.architectures`), every safetensors file of the directory (the
files `model.safetensors.index.json` names when there is one, else `*.safetensors`), maps each tensor to our
parameter name and layout, converts it to the requested dtype (float32 or bfloat16), and places it on the model's
sharding (the default device, or a mesh). Nothing is downloaded. Every problem names the tensor or field: a missing
tensor, a shape that disagrees with `config.json` (checked as stored, in HF layout, so a tensor stored transposed is
refused rather than reshaped), an unknown or duplicated tensor, a dtype safetensors allows but we do not read, a
tied model's head copy that is not its embedding.

Export writes the inverse: `model.safetensors` in HF names and [out, in] layouts, `config.json`, and the tokenizer
files, a directory `transformers` (and so vLLM) loads.

The safetensors format is read and written here directly (an 8-byte header length, a JSON header of name -> dtype,
shape, byte offsets, then the raw little-endian bytes) so bfloat16 maps onto `ml_dtypes.bfloat16` without a
framework in between, and files are memory-mapped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import mmap
import pathlib
import re
import shutil
import struct
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

from grpo_stream.common.model.architectures import Architecture, ArchitectureError, from_hf_config, to_hf_config
from grpo_stream.common.model.families import family_of

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
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object of tensors; the file is corrupt")
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, start = _entry(path, name, info, len(data) - base)
        yield name, np.frombuffer(data, dtype, int(np.prod(shape)), base + start).reshape(shape)


def _entry(path: pathlib.Path, name: str, info: Any, data_bytes: int) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, start offset) of one header entry, checked against the `data_bytes` after the header: a
    malformed entry would otherwise raise a bare KeyError, or read the header's own bytes as weights."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(f"{path}: tensor {name}: header entry {repr(info)[:120]} lacks dtype, shape or "
                              "data_offsets; the file is corrupt")
    if not isinstance(info["dtype"], str) or info["dtype"] not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name} has dtype {info['dtype']}; readable dtypes: {', '.join(DTYPES)}")
    shape, offsets = info["shape"], info["data_offsets"]
    lists = isinstance(shape, list) and isinstance(offsets, list) and len(offsets) == 2
    if not lists or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in [*shape, *offsets]):
        raise CheckpointError(f"{path}: tensor {name} has shape {shape!r} and data_offsets {offsets!r}; both must "
                              "list non-negative integers; the file is corrupt")
    dtype, (start, end) = DTYPES[info["dtype"]], offsets
    if end - start != dtype.itemsize * int(np.prod(shape)) or end > data_bytes:
        raise CheckpointError(f"{path}: tensor {name} has {end - start} bytes for shape {list(shape)} "
                              f"{info['dtype']}, or runs past the end of the file; the file is corrupt")
    return dtype, tuple(shape), start


@dataclasses.dataclass(frozen=True)
class PendingTensor:
    """A tensor `write_safetensors` makes only when it writes it (`make()`), so a converter holds one tensor at a time
    rather than the whole checkpoint; `dtype` and `shape` go into the header first and must be what `make` returns."""
    dtype: np.dtype
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]


def write_safetensors(path: pathlib.Path, tensors: Mapping[str, np.ndarray | PendingTensor],
                      metadata: dict | None = None) -> None:
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, arr in tensors.items():
        dtype, shape = np.dtype(arr.dtype), tuple(arr.shape)
        if dtype not in _CODES:
            raise ValueError(f"tensor {name}: dtype {dtype} cannot be written")
        nbytes = dtype.itemsize * int(np.prod(shape))
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for name, arr in tensors.items():
            value = np.ascontiguousarray(arr.make() if isinstance(arr, PendingTensor) else arr)
            if value.dtype != arr.dtype or tuple(value.shape) != tuple(arr.shape):
                raise ValueError(f"tensor {name}: made as {value.dtype}{list(value.shape)}, declared "
                                 f"{np.dtype(arr.dtype)}{list(arr.shape)}")
            out.write(value.reshape(-1).view(np.uint8).data)  # no copy (tobytes would make one)


SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"  # what tie_word_embeddings ties


def checkpoint_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """A checkpoint directory's weight files, chosen as transformers chooses them: model.safetensors when it is there
    (an index beside it is an older save's), else the shards model.safetensors.index.json names, else every
    *.safetensors."""
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    index = directory / INDEX_FILE
    if index.exists():
        names = sorted(set(_index_files(index)))
        missing = [n for n in names if not (directory / n).exists()]
        if missing:
            raise CheckpointError(f"{index} names files that are not there: {missing}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files (and no model.safetensors.index.json)")
    return files


def _index_files(index: pathlib.Path) -> list[str]:
    """The shard file names `index`'s weight_map lists; each must be a plain file name in the index's directory (an
    absolute path or `../` would load weights from elsewhere on the machine, which a downloaded checkpoint may not)."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: not a JSON object with a weight_map of tensor name -> shard file; the file is "
                              "corrupt (delete it to load every *.safetensors file of the directory)")
    for name in weight_map.values():
        if not isinstance(name, str) or pathlib.PurePath(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{index}: weight_map names the shard {name!r}; shards must be file names in the "
                                  "checkpoint's own directory (no path)")
    return list(weight_map.values())


# ---- names and layouts ----------------------------------------------------------------------------------------
# each family's names and layouts are its record's NameMap (grpo_stream.common.model.families); these apply them

@functools.lru_cache(maxsize=16)
def _hf_rules(arch: Architecture) -> list[tuple[re.Pattern, str, Callable]]:
    """(compiled HF name pattern, our name template, HF array -> our layout) for every tensor of `arch`."""
    return [(re.compile(p + "$"), template, layout) for p, template, layout in family_of(arch).names.from_hf(arch)]


def to_our_names(arch: Architecture, hf_name: str) -> tuple[str, Callable] | None:
    """Our name and the HF -> our layout function for an HF tensor; None for tensors with nothing to hold."""
    if "rotary_emb" in hf_name or (arch.tied_embeddings and hf_name == TIED_HEAD):
        return None  # tied: the head is the embedding; some exports still write a copy (check_stored_tensors)
    for pattern, template, layout in _hf_rules(arch):
        match = pattern.match(hf_name)
        if match:
            return template.format(*match.groups()), layout
    raise CheckpointError(f"tensor {hf_name}: not part of a {arch.family} model as config.json describes it "
                          "(check model_type, tie_word_embeddings, attention_bias)")


def to_hf_names(arch: Architecture, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `to_our_names`: HF names and [out, in] layouts."""
    return {k: np.ascontiguousarray(v) for k, v in family_of(arch).names.to_hf(arch, named).items()}


def _is_pending(arch: Architecture, name: str) -> bool:
    """True for a name read in parts that the family's NameMap assembles after reading (Gemma's q/k/v)."""
    pending = family_of(arch).names.pending
    return pending is not None and re.search(pending, name) is not None


# ---- directories ----------------------------------------------------------------------------------------------

HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"]


def resolve_model_dir(path: str, field: str = "model.path") -> pathlib.Path:
    """A local model directory for `path` (the setting `field`, named in errors): the directory itself, or a Hugging
    Face hub id (`org/name`) resolved through the local Hugging Face cache, downloading only where a network and
    permission exist (HF_HUB_OFFLINE=1 keeps it to the cache)."""
    local = pathlib.Path(path)
    if local.is_dir():
        return local
    if local.is_absolute() or path.startswith(".") or path.count("/") != 1:
        raise CheckpointError(f"{field}={path}: no such directory (and not a hub id like org/name)")
    # deferred: huggingface_hub, for a hub id only
    from huggingface_hub import snapshot_download  # noqa: PLC0415
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError  # noqa: PLC0415 - deferred: as above

    try:
        return pathlib.Path(snapshot_download(repo_id=path, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as exc:
        # a relative org/name is also how a local directory not made yet reads (the shipped real-model configs')
        made_here = (" If it is a local directory not built yet, build it first (models/smollm2-135m-instruct: "
                     "`grpo-stream fixture smollm2`).")
        raise CheckpointError(f"{field}={path}: not a local directory, and the hub/cache could not provide it "
                              f"({type(exc).__name__}: {str(exc)[:300]}).{made_here}") from None


_HF_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's index in a tensor's HF name


def read_architecture(directory: str | pathlib.Path, field: str = "model.path") -> Architecture:
    """The Architecture of `directory`'s config.json (the setting `field` points there, named in errors)."""
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json; point {field} at a Hugging Face model directory")
    try:
        return from_hf_config(json.loads(path.read_text()), str(path))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def check_stored_tensors(directory: str | pathlib.Path, arch: Architecture) -> None:
    """config.json against the checkpoint's tensors, before the model's shapes are built: the layers they hold (their
    headers only: a config.json of a million layers beside a small checkpoint took hours to build, 55 s for 200 layers
    on CPU, before any tensor was compared), and a tied model's lm_head.weight copy, if any, against its embedding
    (transformers unties a checkpoint whose copy differs and computes with the copy; compared in slices of rows)."""
    stored = {n: a for path in checkpoint_files(pathlib.Path(directory)) for n, a in read_safetensors(path)}
    found = {int(m.group(1)) for hf_name in stored if (m := _HF_LAYER.search(hf_name))}
    if arch.num_layers > len(found):
        raise CheckpointError(f"{directory}: config.json's num_hidden_layers={arch.num_layers}, but the checkpoint's "
                              f"tensors hold {len(found)} layers; an incomplete download, or a config.json of another "
                              "model")
    head, embed, rows = stored.get(TIED_HEAD), stored.get(TIED_EMBEDDING), 4096
    if arch.tied_embeddings and head is not None and embed is not None and not (head.shape == embed.shape and all(
            np.array_equal(head[i:i + rows], embed[i:i + rows]) for i in range(0, len(embed), rows))):
        raise CheckpointError(f"{directory}: {TIED_HEAD} differs from {TIED_EMBEDDING}, but config.json's "
                              "tie_word_embeddings=true (Gemma's default) ties them: transformers would untie the "
                              f"model and compute with {TIED_HEAD}, this loader with the embedding. Set "
                              f"tie_word_embeddings to false to use {TIED_HEAD} (Llama, Qwen), or delete it")


def hf_shapes(arch: Architecture, expected: Mapping[str, tuple]) -> dict[str, tuple[int, ...]]:
    """HF name -> the shape config.json implies for it in HF's [out, in] layout: `expected` (our names and layouts)
    passed through the family's own export map, on zero-stride dummies, so nothing the size of the model is made."""
    dummy = np.zeros((), np.float32)
    dummies = {name: np.broadcast_to(dummy, shape) for name, shape in expected.items()}
    return {hf_name: tuple(value.shape) for hf_name, value in family_of(arch).names.to_hf(arch, dummies).items()}


def _shape_error(where: str, hf_name: str, got: tuple, want: tuple) -> CheckpointError:
    """A tensor whose HF-layout shape is not what config.json implies, with the likely cause."""
    if len(got) == 2 and got == want[::-1]:
        cause = ("the tensor is stored transposed ([in, out], as JAX/Flax kernels are); transpose it to HF's "
                 "[out, in] before saving the checkpoint")
    else:
        cause = ("config.json does not describe this checkpoint (check hidden_size, intermediate_size, "
                 "num_attention_heads, num_key_value_heads, head_dim, vocab_size), or the file belongs to another "
                 "model")
    return CheckpointError(f"{where}: tensor {hf_name} has shape {list(got)}; config.json implies {list(want)} in "
                           f"Hugging Face's [out, in] layout: {cause}")


def read_named(directory: str | pathlib.Path, arch: Architecture, expected: dict[str, tuple],
               dtype: np.dtype) -> dict[str, np.ndarray]:
    """Our-named arrays in `dtype`, checked against `expected` (name -> shape): nothing missing, extra or misshapen.

    Shapes are checked as stored, in HF layout, before our layout is applied: a reshape into our layout can succeed
    on a tensor stored transposed ([in, out]) and scramble it silently. (A square tensor stored transposed, such
    as o_proj when heads * head_dim == hidden_size, has the right shape and cannot be told by its shape.)"""
    directory = pathlib.Path(directory)
    want_hf = hf_shapes(arch, expected)
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
            if name not in expected and not _is_pending(arch, name):
                raise CheckpointError(f"{path.name}: tensor {hf_name} has no place in the model config.json "
                                      f"describes (num_hidden_layers={arch.num_layers}?)")
            if hf_name in want_hf and tuple(array.shape) != want_hf[hf_name]:
                raise _shape_error(path.name, hf_name, tuple(array.shape), want_hf[hf_name])
            value = _laid_out(path.name, hf_name, array, layout, name, expected)
            named[name], source[name] = value.astype(dtype, copy=False), path
    assemble = family_of(arch).names.assemble
    if assemble is not None:
        try:
            named = assemble(named, arch)
        except ValueError as exc:  # parts that cannot be stacked, named by the family
            raise CheckpointError(f"{directory}: {exc}") from None
        for name, value in named.items():
            if tuple(value.shape) != tuple(expected.get(name, value.shape)):
                raise CheckpointError(f"{directory}: {name} assembled to shape {list(value.shape)}; config.json "
                                      f"implies {list(expected[name])}")
    missing = sorted(set(expected) - set(named))
    if missing:
        raise CheckpointError(f"{directory}: tensors missing for {len(missing)} parameters, e.g. {missing[:3]} "
                              "(an incomplete download, or tie_word_embeddings wrong in config.json)")
    return named


def _laid_out(where: str, hf_name: str, array: np.ndarray, layout: Callable, name: str,
              expected: Mapping[str, tuple]) -> np.ndarray:
    """`array` in our layout, checked against `expected[name]` (a backstop for names `hf_shapes` does not cover)."""
    want = expected.get(name)
    try:
        value = layout(array)
    except ValueError:  # a reshape that cannot work: the HF shape disagrees with config.json
        raise CheckpointError(f"{where}: tensor {hf_name} has shape {list(array.shape)}, which cannot be laid out as "
                              f"{name} {list(want) if want else ''}; check config.json's shapes") from None
    if want is not None and tuple(value.shape) != tuple(want):
        raise CheckpointError(f"{where}: tensor {hf_name} has shape {list(array.shape)}, {list(value.shape)} in our "
                              f"layout for {name}; config.json implies {list(want)} in our layout")
    return value


def write_hf_config(directory: pathlib.Path, arch: Architecture, dtype: str = "float32",
                    eos_ids: list[int] | None = None, pad_id: int | None = None, bos_id: int | None = None) -> dict:
    """`directory/config.json` for `arch`, with the run's stop, pad and (the source's) BOS tokens; returns it."""
    config = to_hf_config(arch, dtype)
    if bos_id is not None:  # else transformers' class default (Llama's 1, not Llama 3's 128000) would stand
        config["bos_token_id"] = bos_id
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else list(eos_ids)
    if pad_id is not None:
        config["pad_token_id"] = pad_id
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return config


def _remove_sharded(directory: pathlib.Path) -> None:
    """An export replaces a sharded checkpoint in its directory: the old index and the shards it names go. Left there,
    vLLM loads the shards the index names and not model.safetensors (other readers glob every *.safetensors and mix
    the old weights into the new)."""
    index = directory / INDEX_FILE
    if not index.exists():
        return
    try:
        shards = set(_index_files(index)) - {SINGLE_FILE}
    except CheckpointError:
        shards = set()  # a damaged index names nothing to trust: it goes, whatever it meant
    for name in shards:
        (directory / name).unlink(missing_ok=True)
    index.unlink()


def export_hf(directory: str | pathlib.Path, arch: Architecture, named: dict[str, np.ndarray],
              tokenizer_dir: str | pathlib.Path | None = None, dtype: str = "float32",
              eos_ids: list[int] | None = None, pad_id: int | None = None) -> pathlib.Path:
    """Write a Hugging Face model directory: model.safetensors, config.json and the tokenizer files.

    `eos_ids`/`pad_id` (the run's stop and pad tokens) go into config.json and, unless the source directory brought its
    own, a generation_config.json, so `generate` on the export stops where the run's sampler did."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    np_dtype = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}[dtype]
    # converted one at a time as they are written: the host holds `named` and one tensor in the export's layout,
    # not a second (and third) copy of the model (a 70B export on the trainer's first process)
    tensors = {k: PendingTensor(np_dtype, tuple(v.shape), lambda v=v: v.astype(np_dtype, copy=False))
               for k, v in family_of(arch).names.to_hf(arch, named).items()}
    _remove_sharded(out)
    write_safetensors(out / SINGLE_FILE, tensors)
    source = pathlib.Path(tokenizer_dir) / "config.json" if tokenizer_dir is not None else None
    bos = json.loads(source.read_text()).get("bos_token_id") if source is not None and source.exists() else None
    config = write_hf_config(out, arch, dtype, eos_ids, pad_id, bos if isinstance(bos, int) else None)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            src = pathlib.Path(tokenizer_dir) / name
            if src.exists() and src.resolve() != (out / name).resolve():
                shutil.copy(src, out / name)
    if eos_ids and not (out / "generation_config.json").exists():
        (out / "generation_config.json").write_text(json.dumps(
            {k: config[k] for k in ("eos_token_id", "pad_token_id") if k in config}, indent=2) + "\n")
    return out


__all__ = ["ArchitectureError", "CheckpointError", "PendingTensor", "check_stored_tensors", "checkpoint_files",
           "export_hf", "hf_shapes", "read_architecture", "read_named", "read_safetensors", "to_hf_names",
           "to_our_names", "write_hf_config", "write_safetensors"]
