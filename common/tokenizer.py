"""Tokenizers: a locally trained BPE for the tiny demo model.

The tiny model's tokenizer is trained at start-up from generated task text
(digits kept as single tokens, as Llama and Qwen do). Training is
deterministic, so the trainer and every sampler build the same vocabulary
independently; `fingerprint` lets them check that they agree.
"""

from __future__ import annotations

import hashlib
import pathlib

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([i for i in ids if i not in (self.pad_id, self.eos_id)], skip_special_tokens=True)

    def fingerprint(self) -> str:
        return hashlib.sha256(self._tok.to_str().encode()).hexdigest()[:16]

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        path = pathlib.Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path / "tokenizer.json"))
        return path / "tokenizer.json"


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
