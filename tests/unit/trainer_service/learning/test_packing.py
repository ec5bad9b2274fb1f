"""The packer (trainer_service/learning/packing.py): every live sequence placed once, whole, in a row it fits, attending
only to itself with positions from 0; the per-sequence windows point at each completion token's logprob; the pass
size follows trainer.tokens_per_micro_batch; bad settings are refused naming the field."""

import numpy as np
import pytest

from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.model.families.record import Architecture
from grpo_stream.trainer_service.learning.packing import (PackingLayout, first_fit_decreasing, pack_minibatch, packing_layout,
                                                 rows_per_micro_batch)
from tests.unit.trainer_service.learning.packing_cases import COMPLETION, PROMPT, layout, random_batch
from tests.unit.trainer_service.learning.packing_cases import one_a_row as one_a_row_layout


GEMMA2 = Architecture(family="gemma2", vocab_size=256, num_layers=2, embed_dim=64, hidden_dim=128, num_heads=2,
                      num_kv_heads=1, head_dim=32, norm_eps=1e-6, rope_theta=1e4, tied_embeddings=True,
                      sliding_window=32)


def packed(seed=0, rows=4, one_a_row=False):
    b = random_batch(seed)
    fields = [np.asarray(x) for x in (b.tokens, b.valid, b.loss_mask, b.behaviour_logprobs, b.advantages, b.fresh)]
    return fields, pack_minibatch(*fields, (one_a_row_layout if one_a_row else layout)(rows), pad_id=0)


def test_first_fit_decreasing_respects_the_row_length_and_slots_and_is_deterministic():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 40, 200)
    rows = first_fit_decreasing(lengths, 64, 5)
    assert sorted(i for row in rows for i in row) == list(range(200))
    assert all(lengths[row].sum() <= 64 and len(row) <= 5 for row in rows)
    assert rows == first_fit_decreasing(lengths, 64, 5)
    assert len(rows) <= np.ceil(lengths.sum() / 64) * 11 / 9 + 1  # FFD's bound: 11/9 OPT + 6/9
    with pytest.raises(ValueError, match="a sequence of 65 tokens does not fit a packed row of 64"):
        first_fit_decreasing(np.array([65]), 64, 5)


def test_each_live_sequence_is_one_segment_with_its_tokens_positions_and_completion_window():
    (tokens, valid, mask, behaviour, advantages, fresh), pack = packed()
    live = set(np.flatnonzero(mask.sum(axis=1) > 0))
    x, seen = pack.passes, []
    assert x.tokens.shape == (6, 4, PROMPT + COMPLETION)  # room for one sequence a row: 24 / 4 passes
    assert 1 <= pack.count < 6 and not x.segments[pack.count:].any()  # the rest of the stack is never used
    for k, r, s in zip(*np.nonzero(pack.sources >= 0)):
        i = pack.sources[k, r, s]
        seen.append(i)
        where = x.segments[k, r] == s + 1
        np.testing.assert_array_equal(x.tokens[k, r][where], tokens[i][valid[i]])  # whole, in order
        np.testing.assert_array_equal(x.positions[k, r][where], np.arange(where.sum()))  # from 0
        c = int(valid[i, PROMPT:].sum())
        assert x.lengths[k, r, s] == c
        at = x.starts[k, r, s] + np.arange(c)
        # the logprob at a position predicts the token after it: completion token j of sequence i
        np.testing.assert_array_equal(x.tokens[k, r][at + 1], tokens[i, PROMPT:PROMPT + c])
        np.testing.assert_array_equal(x.loss_mask[k, r][at], mask[i, PROMPT - 1:PROMPT - 1 + c])
        np.testing.assert_array_equal(x.behaviour[k, r][at], behaviour[i, PROMPT - 1:PROMPT - 1 + c])
        assert x.advantages[k, r, s] == advantages[i] and x.fresh[k, r, s] == fresh[i]
    assert not x.lengths[pack.sources < 0].any()  # empty slots count for nothing
    assert x.loss_mask.sum() == mask.sum()  # and no token is in the loss twice
    assert sorted(seen) == sorted(live)  # sequences with nothing in the loss are left out, the rest placed once
    assert pack.normalizers == (float(mask.sum()), float(len(live)))
    assert pack.real_tokens() == int(valid[sorted(live)].sum())
    assert pack.laid_out_tokens() == pack.count * 4 * (PROMPT + COMPLETION)


def test_a_minibatch_with_nothing_in_the_loss_still_makes_one_empty_pass():
    (tokens, valid, mask, behaviour, advantages, fresh), _ = packed()
    pack = pack_minibatch(tokens, valid, np.zeros_like(mask), behaviour, advantages, fresh, layout(), pad_id=0)
    assert pack.count == 1 and not pack.passes.segments.any()
    assert pack.normalizers == (0.0, 0.0)


def test_a_minibatch_larger_than_the_configured_one_gets_more_passes():
    b = random_batch(0, n=48)
    fields = [np.asarray(x) for x in (b.tokens, b.valid, b.loss_mask, b.behaviour_logprobs, b.advantages, b.fresh)]
    pack = pack_minibatch(*fields, layout(rows=2, sequences=8), pad_id=0)
    assert pack.passes.tokens.shape[0] == pack.count > 4


def test_a_loss_mask_outside_the_completion_window_is_refused():
    (tokens, valid, mask, behaviour, advantages, fresh), _ = packed()
    prompt = mask.copy()
    prompt[0, 2] = 1.0
    with pytest.raises(ValueError, match="covers prompt positions"):
        pack_minibatch(tokens, valid, prompt, behaviour, advantages, fresh, layout(), pad_id=0)
    past = mask.copy()
    short = int(np.argmin(valid[:, PROMPT:].sum(axis=1)))
    past[short, PROMPT - 1 + COMPLETION - 1] = 1.0
    with pytest.raises(ValueError, match="past a sequence's completion"):
        pack_minibatch(tokens, valid, past, behaviour, advantages, fresh, layout(), pad_id=0)


def test_the_pass_size_follows_the_token_budget_and_the_mesh():
    assert rows_per_micro_batch(4096, None, 64, 1024, 1) == 4
    assert rows_per_micro_batch(5000, 2, 64, 1024, 1) == 4  # the budget wins over micro_batch_size
    assert rows_per_micro_batch(None, 6, 64, 1024, 4) == 8  # rounded up to whole rows per fsdp device
    assert rows_per_micro_batch(None, None, 64, 1024, 1) == 16  # a quarter of the minibatch's sequences
    cfg = load_config("configs/tiny_arith.yaml", ["trainer.tokens_per_micro_batch=420"])
    assert packing_layout(cfg, 1).rows == 10 and packing_layout(cfg, 4).rows == 12
    assert packing_layout(cfg, 1).passes == 13  # 128 sequences a minibatch, one a row at most


def test_a_pass_never_lays_out_more_rows_than_the_minibatch_has_sequences():
    """Each row holds at least one sequence: a budget past the minibatch's sequences would only add empty rows,
    which each pass computes as full ones (1M tokens of 42-token rows were 23,809 rows for 128 sequences)."""
    assert rows_per_micro_batch(1_000_000, None, 128, 42, 1) == 128
    assert rows_per_micro_batch(None, 100_000, 128, 42, 1) == 128
    assert rows_per_micro_batch(1_000_000, None, 6, 42, 4) == 8  # still whole rows per fsdp device
    for override in ("trainer.tokens_per_micro_batch=1000000", "trainer.micro_batch_size=100000"):
        cfg = load_config("configs/tiny_arith.yaml", [override])
        assert packing_layout(cfg, 1) == PackingLayout(24, 42, 128, 4, 1)
        assert packing_layout(cfg, 3).rows == 129



def test_packing_false_is_one_sequence_a_row_through_the_same_update():
    """trainer.packing=false: one segment a row, trainer.micro_batch_size rows a pass (null: the whole minibatch),
    rounded up to whole rows per fsdp device; each sequence sits at the start of its row, its positions its
    indices (so a Gemma 2 sliding window of any size is placed as in the padded row)."""
    off = load_config("configs/tiny_arith.yaml", ["trainer.packing=false"])
    assert packing_layout(off, 1) == PackingLayout(24, 42, 128, 1, 1)
    assert packing_layout(off, 1, GEMMA2) == PackingLayout(24, 42, 128, 1, 1)  # no refusal: one sequence a row
    micro = load_config("configs/tiny_arith.yaml", ["trainer.packing=false", "trainer.micro_batch_size=16"])
    assert packing_layout(micro, 1) == PackingLayout(24, 42, 16, 1, 8) and packing_layout(micro, 3).rows == 18
    (tokens, valid, *_), pack = packed(rows=4, one_a_row=True)
    x = pack.passes
    for k, r in zip(*np.nonzero(pack.sources[..., 0] >= 0)):
        i = pack.sources[k, r, 0]
        n = int(valid[i].sum())
        np.testing.assert_array_equal(x.tokens[k, r, :n], tokens[i][valid[i]])
        np.testing.assert_array_equal(x.positions[k, r, :n], np.arange(n))
        assert (x.segments[k, r, :n] == 1).all() and not x.segments[k, r, n:].any()


def test_bad_packing_settings_are_refused_naming_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=r"trainer.tokens_per_micro_batch=40 is below one row of .* = 42 tokens; "
                                          "raise it to at least 42"):
        load_config("configs/tiny_arith.yaml", ["trainer.tokens_per_micro_batch=40"])
    with pytest.raises(ConfigError, match="with trainer.packing=false use trainer.micro_batch_size"):
        load_config("configs/tiny_arith.yaml", ["trainer.tokens_per_micro_batch=420", "trainer.packing=false"])
    with pytest.raises(ValueError, match="sliding window of 32 tokens is shorter than a packed row of 42.*"
                                         "set trainer.packing=false"):
        packing_layout(load_config("configs/tiny_arith.yaml", []), 1, GEMMA2)
