"""A GGUF file's tokenizer as Hugging Face tokenizer files: tokenizer.json rebuilt with `tokenizers` from the file's
vocabulary and merges, tokenizer_config.json (special tokens, the chat template), generation_config.json.

Only byte-level BPE (`tokenizer.ggml.model = gpt2`) with a pre-tokenizer whose splitting we reproduce exactly is
converted: llama.cpp names the pre-tokenizer (`tokenizer.ggml.pre`) rather than storing its regular expressions, so
each name maps to the `tokenizers` pipeline that splits as llama.cpp's expressions for it do. Another name is
refused: a near miss would tokenize differently in places no test sees.

`tokenizer_class` is written as PreTrainedTokenizerFast so that `transformers.AutoTokenizer` loads tokenizer.json as
written (transformers 5 swaps in a family's own tokenizer class, with its own pre-tokenizer, for other names), and
HFTokenizer does the same.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

CONTROL = 3  # llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
USER_DEFINED = 4


class GgufError(ValueError):
    """A GGUF file this converter cannot turn into a faithful Hugging Face directory; names the field or tensor."""


def _smollm() -> pre_tokenizers.PreTokenizer:
    # llama.cpp's `smollm` (as its starcoder): "\p{N}" (each digit alone), then GPT-2's expression
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


PRE_TOKENIZERS = {"smollm": _smollm}


def build_tokenizer(meta: Any) -> Tokenizer:
    """The `tokenizers` Tokenizer of a GGUF file's metadata (a gguf_import.Metadata)."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise GgufError(f"{meta.where}: tokenizer.ggml.model={kind!r}; only byte-level BPE ('gpt2') is converted")
    if pre not in PRE_TOKENIZERS:
        raise GgufError(f"{meta.where}: tokenizer.ggml.pre={pre!r}; converted pre-tokenizers: "
                         f"{', '.join(PRE_TOKENIZERS)} (each must split exactly as llama.cpp's)")
    if meta.get("tokenizer.ggml.add_bos_token", False) or meta.get("tokenizer.ggml.add_eos_token", False):
        raise GgufError(f"{meta.where}: tokenizer.ggml.add_bos_token/add_eos_token is set; only tokenizers that "
                         "add no tokens of their own are converted")
    tokens, types = _listed(meta, "tokenizer.ggml.tokens", str), _listed(meta, "tokenizer.ggml.token_type", int)
    merges = []
    for rank, merge in enumerate(_listed(meta, "tokenizer.ggml.merges", str)):
        pair = merge.split(" ")
        if len(pair) != 2:
            raise GgufError(f"{meta.where}: tokenizer.ggml.merges[{rank}]={merge!r} is not two tokens")
        merges.append((pair[0], pair[1]))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens) or len(types) != len(tokens):
        raise GgufError(f"{meta.where}: tokenizer.ggml.tokens has repeated tokens, or token_type another length")
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as exc:  # noqa: BLE001 - `tokenizers` raises a bare Exception for a merge of an unknown token
        raise GgufError(f"{meta.where}: tokenizer.ggml.merges does not fit tokenizer.ggml.tokens ({exc}); the file's "
                        "tokenizer is damaged") from None
    tokenizer.pre_tokenizer = PRE_TOKENIZERS[pre]()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # control tokens are special (matched whole, dropped by skip_special_tokens); user-defined ones are matched whole
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, t in enumerate(types) if t == CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, t in enumerate(types) if t == USER_DEFINED])
    return tokenizer


def _listed(meta: Any, key: str, kind: type) -> list:
    """A list field the BPE model is built from, each item a `kind`; a file without it has no byte-level BPE tokenizer
    to convert. Item types are checked: a token type stored as text would never equal CONTROL, and the control tokens
    (<|im_end|>...) would be split into pieces without a word."""
    value = meta.get(key)
    if value is None:
        raise GgufError(f"{meta.where}: metadata field {key} is missing; a byte-level BPE tokenizer needs "
                        "tokenizer.ggml.tokens, token_type and merges (re-convert the model with llama.cpp's "
                        "convert_hf_to_gguf.py, which writes them)")
    if not isinstance(value, list):
        raise GgufError(f"{meta.where}: metadata field {key} is a {type(value).__name__}, not an array")
    for index, item in enumerate(value):
        if not isinstance(item, kind) or isinstance(item, bool):
            raise GgufError(f"{meta.where}: metadata field {key}[{index}]={item!r} is not of type {kind.__name__} (the "
                            "array has the wrong item type; the file's tokenizer is damaged)")
    return value


def _token(meta: Any, tokens: list[str], key: str) -> str | None:
    index = meta.get(key)
    if index is None:
        return None
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(tokens):
        raise GgufError(f"{meta.where}: {key}={index!r} is not a token id of the vocabulary of {len(tokens)}")
    return tokens[index]


def write_tokenizer_files(out: pathlib.Path, meta: Any, pad_token: str | None, max_length: int) -> dict:
    """tokenizer.json, tokenizer_config.json and generation_config.json in `out`; returns the ids config.json
    states (bos/eos/pad_token_id). Stop tokens: the end-of-sequence token and, as llama.cpp ends generation on them
    too, the end-of-turn and end-of-message ones (generation_config.json's eos_token_id list). `pad_token` replaces
    the file's padding token (which must then not be a stop token: padding is never sampled, so a model padded with
    its stop token could not stop)."""
    tokenizer = build_tokenizer(meta)
    tokens = _listed(meta, "tokenizer.ggml.tokens", str)
    bos, eos = _token(meta, tokens, "tokenizer.ggml.bos_token_id"), _token(meta, tokens, "tokenizer.ggml.eos_token_id")
    unk = _token(meta, tokens, "tokenizer.ggml.unknown_token_id")
    pad = pad_token or _token(meta, tokens, "tokenizer.ggml.padding_token_id")
    if eos is None:
        raise GgufError(f"{meta.where}: tokenizer.ggml.eos_token_id is missing; the model could not stop")
    stops = list(dict.fromkeys(t for t in [eos, *(_token(meta, tokens, f"tokenizer.ggml.{k}_token_id")
                                                  for k in ("eot", "eom"))] if t is not None))
    if pad is None or pad in stops or tokenizer.token_to_id(pad) is None:
        raise GgufError(f"{meta.where}: padding token {pad!r} is missing, not a token, or a stop token "
                        f"({', '.join(map(repr, stops))}); name another token to pad with")
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise GgufError(f"{meta.where}: metadata field tokenizer.chat_template is a {type(template).__name__}, not "
                        "the template's text")
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "unk_token": unk,
              "pad_token": pad, "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    if template:
        config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                          indent=2, ensure_ascii=False) + "\n")
    ids = {"bos_token_id": tokenizer.token_to_id(bos) if bos else None, "eos_token_id": tokenizer.token_to_id(eos),
           "pad_token_id": tokenizer.token_to_id(pad)}
    ids = {k: v for k, v in ids.items() if v is not None}
    stop_ids = [tokenizer.token_to_id(t) for t in stops]
    generation = {**ids, "eos_token_id": stop_ids if len(stop_ids) > 1 else stop_ids[0]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ids


__all__ = ["GgufError", "PRE_TOKENIZERS", "build_tokenizer", "write_tokenizer_files"]
