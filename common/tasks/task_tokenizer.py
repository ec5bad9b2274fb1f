"""The tiny model's tokenizer: a BPE trained deterministically on a task's own text, the same in every process (a
checkpoint's run uses the checkpoint's tokenizer instead)."""

from __future__ import annotations

from grpo_stream.common.model.tokenizer import TextTokenizer, train_bpe

TOKENIZER_CORPUS_SIZE = 4000  # texts of the task a BPE is trained on


def build_tokenizer(cfg, task) -> TextTokenizer:
    """A BPE of model.tiny.vocab_size tokens trained on `task.corpus(TOKENIZER_CORPUS_SIZE)`."""
    return train_bpe(task.corpus(TOKENIZER_CORPUS_SIZE), cfg.model.tiny.vocab_size)


def build_tokenizer_on(texts: list[str], cfg) -> TextTokenizer:
    """A BPE of model.tiny.vocab_size tokens trained on the first TOKENIZER_CORPUS_SIZE of `texts`."""
    return train_bpe(texts[:TOKENIZER_CORPUS_SIZE], cfg.model.tiny.vocab_size)
