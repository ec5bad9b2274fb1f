"""Tokenizers: a locally trained BPE for the tiny demo model, and Hugging Face tokenizers from a directory.

The tiny model's tokenizer is trained at start-up from generated task text
(digits kept as single tokens, as Llama and Qwen do). Training is
deterministic, so the trainer and every sampler build the same vocabulary
independently; `fingerprint` lets them check that they agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import re
import threading

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from grpo_stream.common.tools import template_tools

log = logging.getLogger(__name__)

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
AUTO_PAD = "auto"  # model.pad_token: pick a safe special token (HFTokenizer.pad_candidates)
# transformers' lazy top-level module is not safe to import from two threads at once (the second one can get
# "cannot import name 'AutoTokenizer'"): weights.transport=local's trainer and sampler threads load their tokenizers
# together
_TRANSFORMERS_IMPORT = threading.Lock()


def _byte_level_alphabet() -> dict[str, int]:
    """The character each byte is written as in a byte-level BPE's tokens (GPT-2's table, which Llama 3, Qwen and
    SmolLM2 share): printable bytes as themselves, the others shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens (Gemma, Llama 2)


class _NoTorchNotice(logging.Filter):
    """Drops transformers' import-time notice "PyTorch was not found. Models won't be available...": this package
    uses transformers for tokenizers only (models are JAX), so without torch (the default install) the notice, printed
    by every process at start-up, only misleads. Only that record is dropped; a path that needs torch (the `bench`
    extra's HF `generate`) fails on its own import, and with torch installed the notice is never logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


def _quiet_torch_notice() -> None:
    """Install the filter on transformers' logger (once) before transformers is first imported."""
    logger = logging.getLogger("transformers")
    if not any(isinstance(f, _NoTorchNotice) for f in logger.filters):
        logger.addFilter(_NoTorchNotice())


_MARKUP = re.compile(r"[<>\[\]|]")  # what an added token holds when it is markup, not a word or spaces

class TextTokenizer:
    """What the services need of a tokenizer: ids in, ids out, and the special ids."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.pad_id = self._require(PAD)
        self.eos_id = self._require(EOS)
        self.vocab_size = tokenizer.get_vocab_size()

    def _require(self, token: str) -> int:
        idx = self._tok.token_to_id(token)
        if idx is None:
            raise ValueError(f"tokenizer has no {token} token")
        return idx

    bos_text = ""  # no BOS token
    tool_format = "plain"  # its tokenizer is trained on the demo's <call>f(...)</call> text

    @property
    def eos_ids(self) -> list[int]:
        return [self.eos_id]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """As `encode`: this tokenizer adds no special tokens of its own."""
        return self.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i not in (self.pad_id, self.eos_id)], skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` writes (HFTokenizer.token_bytes); this vocabulary's tokens are whole text."""
        return self._tok.decode([token_id], skip_special_tokens=False).encode()

    def vocab(self) -> dict[str, int]:
        """Token text -> id, special tokens included."""
        return self._tok.get_vocab()

    def fingerprint(self) -> str:
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """tokenizer.json plus a tokenizer_config.json, so `transformers.AutoTokenizer` loads the directory."""
        path = pathlib.Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": PAD, "eos_token": EOS, "unk_token": UNK,
            "model_max_length": 1 << 20}, indent=2) + "\n")
        return path / "tokenizer.json"


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory, with the ids the services need.

    Stop tokens: the tokenizer's EOS plus every `eos_token_id` of the
    directory's generation_config.json (Llama 3 Instruct ends turns with
    <|eot_id|>). The pad token must be a token the policy never has to emit:
    it is removed from the sampling distribution.
    """

    FIELD = "model.path"  # the setting its errors name for the directory (a distillation teacher's: distill.teacher)

    def __init__(self, directory: str | pathlib.Path, pad_token: str | None = None, vocab_size: int | None = None,
                 tool_format: str | None = None):
        with _TRANSFORMERS_IMPORT:
            _quiet_torch_notice()
            from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: PLC0415 - deferred: heavy; kind=hf only

        directory = pathlib.Path(directory)
        config = directory / "tokenizer_config.json"
        declared = _json_object(config, self.FIELD).get("tokenizer_class") if config.exists() else None
        # transformers 5's AutoTokenizer swaps in the model family's tokenizer class (and its pre-tokenizer) when
        # config.json names e.g. qwen3; a plain tokenizer.json (the tiny model's, exported) is loaded as written
        loader = PreTrainedTokenizerFast if declared in ("PreTrainedTokenizerFast", "TokenizersBackend") else AutoTokenizer
        try:
            self._tok = loader.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{self.FIELD}={directory}: no loadable tokenizer there ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - `tokenizers` raises a bare Exception for a tokenizer.json it cannot
            # parse ("data did not match any variant of untagged enum ..."): one written by a newer `tokenizers`
            raise ValueError(f"{self.FIELD}={directory}: no loadable tokenizer there: its tokenizer.json does not "
                             f"parse ({exc}); if a newer `tokenizers` wrote it, install that version (installed: "
                             f"{tokenizers.__version__})") from None
        self.vocab_size = int(vocab_size or len(self._tok))
        self._eos = self._stop_ids(directory)
        self.pad_id = self._pad_id(directory, pad_token)
        self.eos_id = self._eos[0]
        self.bos_text = self._bos_text()  # prepended to plain prompts; chat templates write it themselves
        self._fingerprint_source = directory
        self.tool_format, self.tool_support = self._tools_of(directory, tool_format)

    def _stop_ids(self, directory: pathlib.Path) -> list[int]:
        """The tokenizer's EOS and generation_config.json's eos_token_id, less ids past the model's embedding rows: a
        token tokenizer_config.json names but tokenizer.json lacks is appended past them, and the model never samples
        it (with it the only stop, every completion ran to its budget)."""
        eos = {self._tok.eos_token_id} - {None}
        eos |= set(_declared_eos(directory, self.FIELD))
        outside = sorted(i for i in eos if i >= self.vocab_size)
        named = ", ".join(f"{self._tok.convert_ids_to_tokens(i)!r} (id {i})" for i in outside)
        if outside and eos - set(outside):
            log.warning("%s=%s: the stop tokens %s are past the model's %d embedding rows (config.json "
                        "vocab_size) and are left out: the model cannot sample them", self.FIELD, directory, named,
                        self.vocab_size)
        elif outside:
            raise ValueError(f"{self.FIELD}={directory}: the stop tokens {named} are past the model's "
                             f"{self.vocab_size} embedding rows (config.json vocab_size): the model could never "
                             "stop. Name a stop token of its vocabulary as eos_token_id in generation_config.json")
        if not eos:
            raise ValueError(f"{self.FIELD}={directory}: the tokenizer defines no end-of-sequence token")
        return sorted(eos - set(outside))

    def _bos_text(self) -> str:
        """The BOS token's text where the tokenizer itself puts it before a text (its post-processor: Llama 3's
        <|begin_of_text|>, Gemma's <bos>), else "": a BOS the tokenizer never adds (SmolLM2 names <|im_start|>, its
        GGUF's add_bos_token is false) is not part of a plain prompt as vLLM, transformers or llama.cpp encode it."""
        bos, bos_id = self._tok.bos_token, self._tok.bos_token_id
        added = self._tok.encode("", add_special_tokens=True)
        return bos if bos and bos_id is not None and list(added[:1]) == [bos_id] else ""

    def _pad_id(self, directory: pathlib.Path, pad_token: str | None) -> int:
        """The padding id: model.pad_token's ('auto': the first of `pad_candidates`, logged), else the tokenizer's.
        A stop token is refused (padding is never sampled: the model could not stop), naming safe candidates."""
        if pad_token == AUTO_PAD:
            candidates = self.pad_candidates()
            if not candidates:
                raise ValueError(f"model.pad_token=auto: the tokenizer at {directory} has no special token that is "
                                 "not a stop, BOS or chat-template token; add one (e.g. <|pad|>) and name it")
            log.info("model.pad_token=auto: padding with %r (a special token that is not a stop, BOS or chat-template "
                     "token; others: %s)", candidates[0], candidates[1:5] or "none")
            return int(self._tok.convert_tokens_to_ids(candidates[0]))
        pad = pad_token or self._tok.pad_token
        if pad is None:
            raise ValueError(f"model.pad_token: the tokenizer at {directory} has no pad token; name one that is not "
                             f"an end-of-sequence token{self._suggestion()}")
        pad_id = self._tok.convert_tokens_to_ids(pad)
        if pad_id is None or pad_id == self._tok.unk_token_id and pad != self._tok.unk_token:
            raise ValueError(f"model.pad_token={pad!r} is not a token of the tokenizer at {directory}"
                             f"{self._suggestion()}")
        which = f"model.pad_token={pad!r}" if pad_token else f"the tokenizer's pad token {pad!r} (model.pad_token: null)"
        if pad_id >= self.vocab_size:  # a pad tokenizer_config.json names but tokenizer.json lacks, appended
            raise ValueError(f"{which} has id {pad_id}, past the model's {self.vocab_size} embedding rows (config.json "
                             f"vocab_size): the model has no row for it. Set model.pad_token to a token of the model's "
                             f"vocabulary{self._suggestion()}")
        if pad_id in self._eos:
            raise ValueError(f"{which} is an end-of-sequence token; padding is never sampled, so the model could not "
                             f"stop. Set model.pad_token to another token{self._suggestion()}")
        return int(pad_id)

    def pad_candidates(self) -> list[str]:
        """Special tokens safe to pad with: not a stop token, not the BOS, not written by the chat template (its
        role and turn tokens: <|im_start|>, <|im_end|>, <start_of_turn>...); those named like padding first, then
        end-of-text ones (SmolLM2's <|endoftext|>), then by id."""
        template = getattr(self._tok, "chat_template", None) or ""
        template = template if isinstance(template, str) else " ".join(map(str, dict(template).values()))
        added = getattr(self._tok, "added_tokens_decoder", {}) or {}
        specials = {t.content for t in added.values() if getattr(t, "special", False)}
        specials |= set(self._tok.all_special_tokens)
        ids = {t: self._tok.convert_tokens_to_ids(t) for t in specials}
        safe = [t for t, i in ids.items() if i is not None and i not in self._eos and t != self._tok.bos_token
                and t not in template and i < self.vocab_size]

        def rank(token: str) -> tuple:
            low = token.lower()
            return ("pad" not in low, not any(w in low for w in ("endoftext", "end_of_text", "eot")), ids[token])
        return sorted(safe, key=rank)

    def _suggestion(self) -> str:
        found = self.pad_candidates()[:5]
        return (f" (safe candidates in this vocabulary: {', '.join(found)}; or model.pad_token=auto picks the first)"
                if found else " (this vocabulary has no spare special token: add one, e.g. <|pad|>)")

    def _tools_of(self, directory: pathlib.Path, tool_format: str | None) -> tuple[str, template_tools.ToolSupport]:
        """The tool format (`tool_format`, or inferred from the template and config.json's model_type, said in the
        log) and what the chat template writes of tools itself (template_tools.probe; what it leaves out is written
        in that format, said once in the log)."""
        template = getattr(self._tok, "chat_template", None) or None
        template = json.dumps(template) if isinstance(template, dict) else template  # several named templates
        if tool_format is None:
            config = directory / "config.json"
            model_type = _json_object(config, self.FIELD).get("model_type") if config.exists() else None
            tool_format, why = template_tools.infer_tool_format(template, model_type)
            log.info("%s=%s: environment.tool_format unset; tool calls are written and parsed in the %r "
                     "format (%s)", self.FIELD, directory, tool_format, why)
        if not self.has_chat_template:
            return tool_format, template_tools.ToolSupport()
        support = template_tools.probe(self._template_text)
        if not support.complete:
            log.warning("%s=%s: its chat template does not write %s; they are written into the %s in the "
                        "%r tool format (docs/tools.md), the calls as its parser reads them", self.FIELD, directory,
                        support.missing(), " and ".join(where for where, written in (
                            ("system turn", support.schemas), ("assistant turns", support.calls)) if not written),
                        tool_format)
        return tool_format, support

    @property
    def eos_ids(self) -> list[int]:
        return list(self._eos)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """The ids with what the tokenizer's own post-processor adds (Llama 3's <|begin_of_text|>; nothing for
        SmolLM2's ByteLevel one, whatever its bos_token), as vLLM encodes a text completion prompt."""
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i != self.pad_id and i not in self._eos], skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` writes, exact where a token holds part of a character (CJK, emoji: decoded
        alone it is U+FFFD): a byte-level BPE's token mapped back through its byte alphabet, SentencePiece's
        `<0xNN>` as that byte and its `▁` as a space. An added token is its own text."""
        piece = self._tok.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if self._byte_level:
            # as `tokenizers`' ByteLevel decoder reads a token: its alphabet's characters as their bytes, any other
            # token (an added one: DeepSeek-R1's <｜end▁of▁sentence｜>) as its own text, ▁ included, not a space
            return bytes(_BYTE_LEVEL[c] for c in piece) if all(c in _BYTE_LEVEL for c in piece) else piece.encode()
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    @property
    def _byte_level(self) -> bool:
        decoder = getattr(getattr(self._tok, "backend_tokenizer", None), "decoder", None)
        return type(decoder).__name__ == "ByteLevel"

    def vocab(self) -> dict[str, int]:
        """Token text -> id, added and special tokens included."""
        return self._tok.get_vocab()

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                    tool_format: str | None = None) -> str:
        """The chat template's text for `messages` (multi-turn environments render observations with it), with the
        tools and tool calls it does not write itself written in `tool_format` (default: the run's,
        self.tool_format; common/tools/template_tools.py)."""
        messages, tools = template_tools.for_template(messages, tools, tool_format or self.tool_format,
                                                      self.tool_support)
        return self._template_text(messages, add_generation_prompt, tools)

    def _template_text(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools)

    def special_texts(self) -> list[str]:
        """Every token text that is structure rather than prose: the special tokens (<|im_start|>, <|eot_id|>,
        <start_of_turn>...) and the added tokens written as markup though not "special" (Qwen's <tool_call>,
        </tool_call>, <tool_response>, <think>: a decoded turn keeps them, and a tool's output that printed one would
        otherwise tokenize to the real token). Added tokens of plain text or whitespace (runs of spaces some
        tokenizers add) are prose."""
        added = getattr(self._tok, "added_tokens_decoder", {}) or {}
        markup = {t.content for t in added.values()
                  if getattr(t, "special", False) or _MARKUP.search(t.content or "")}
        return sorted(markup | set(self._tok.all_special_tokens))

    def stop_texts(self) -> list[str]:
        """The stop tokens as text, longest first."""
        return sorted((self._tok.convert_ids_to_tokens(i) for i in self._eos), key=len, reverse=True)

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"):
            path = self._fingerprint_source / name
            if path.exists():
                digest.update(path.read_bytes())
        return digest.hexdigest()[:16]

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        self._tok.save_pretrained(str(directory))
        return pathlib.Path(directory)


def _declared_eos(directory: pathlib.Path, field: str) -> list[int]:
    """generation_config.json's eos_token_id (one id or a list; null: none); without that file config.json's (its
    text_config's for a multimodal one), as transformers and vLLM derive a generation config from config.json (Llama
    3 Instruct's config.json lists <|eot_id|>, which its tokenizer may not name)."""
    path = directory / "generation_config.json"
    if path.exists():
        declared = _json_object(path, field).get("eos_token_id")
    else:
        path = directory / "config.json"
        if not path.exists():
            return []
        data = _json_object(path, field)
        text = data.get("text_config")
        declared = data.get("eos_token_id", text.get("eos_token_id") if isinstance(text, dict) else None)
    ids = [i for i in (declared if isinstance(declared, list) else [declared]) if i is not None]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        # a "2" stopped the load with a TypeError naming neither; a 2.5 or -1 became a stop id no token has
        raise ValueError(f"{field}: {path} states eos_token_id={declared!r}; a token id or a list of token ids "
                         "(integers from 0) is expected")
    return ids


def _json_object(path: pathlib.Path, field: str) -> dict:
    """The JSON object in `path`, or an error naming the file."""
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise ValueError(f"{field}: {path} is not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{field}: {path} holds a {type(data).__name__}, not a JSON object")
    return data


def train_bpe(corpus: list[str], vocab_size: int) -> TextTokenizer:
    """Train a byte-free BPE on `corpus`; spaces become '▁', each digit is its own token."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, EOS, UNK], show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    return TextTokenizer(tok)
