"""The continuous engine's request checks (request_rows.py): a request it cannot serve as asked is refused with an
error that says why, before any of it reaches the device."""

import collections

import jax
import numpy as np
import pytest

from grpo_stream.common.engine.base import Request
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.engine.request_rows import RequestRows

VOCAB = 160


def _rows() -> RequestRows:
    return RequestRows(pad_id=0, eos_ids=(1,), cache_len=64, max_new_tokens=8, vocab_size=VOCAB,
                       stats=collections.Counter(), context_field="generation.max_prompt_tokens")


@pytest.mark.parametrize("ids, forced", [([5, VOCAB], None), ([5, -1], None), ([5, 6, VOCAB + 3], [VOCAB + 3])],
                         ids=["past-the-vocabulary", "negative", "forced"])
def test_token_ids_outside_the_vocabulary_are_refused_not_clamped(ids, forced):
    """The embedding lookup on the device clamps an id past the vocabulary to its last row (and wraps -1 to it):
    served, the request would silently sample another prompt's completion and logprobs."""
    request = Request(ids, 4, np.zeros(2, np.uint32), resume=None if forced is None else "held", forced=forced)
    with pytest.raises(ValueError, match=rf"must lie in 0\.\.{VOCAB - 1}, the model's vocabulary"):
        _rows().register(request, versions=False)


def test_an_empty_prompt_is_refused_as_empty_not_as_too_long():
    with pytest.raises(ValueError, match="no prompt tokens") as caught:
        _rows().register(Request([], 4, np.zeros(2, np.uint32)), versions=False)
    assert "shorten" not in str(caught.value)


def test_requests_within_the_vocabulary_and_the_cache_get_a_row():
    rows = _rows()
    assert rows.register(Request([0, VOCAB - 1], 8, np.zeros(2, np.uint32)), versions=True) == 0
    assert rows.prompt_lens[0] == 2 and len(rows.out[0][0]) == 8


def test_the_engine_refuses_an_id_past_the_vocabulary(tiny_parts):
    cfg, _, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens,
                              cfg.generation.max_new_tokens, 1.0, slots=4, chunk_steps=4)
    with pytest.raises(ValueError, match="the model's vocabulary"):
        engine.generate(model.params, [[5, 6], [5, model.arch.vocab_size]], jax.random.key(0))
