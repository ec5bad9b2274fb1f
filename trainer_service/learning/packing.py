"""Sequence packing for the update: a minibatch's sequences placed into rows of fixed length, several to a row.

The padded layout (batching.py) gives every sequence its own row of P + C tokens (P = max_prompt_tokens, C =
max_new_tokens); on long-tailed completions most of those tokens are padding, and the update's forward and
backward passes pay for them. Here each sequence keeps its tokens (prompt, then completion) as one *segment* of a
row of the same length T = P + C; a row holds as many segments as fit (first-fit decreasing), attention stays within
a segment (segment ids -> a block-diagonal causal mask) and positions restart at 0 in each segment, so each
sequence's logits are exactly those of its padded row. Rows are grouped into micro-batches of a fixed number of rows:
one compiled shape for the whole run, whatever the lengths.

The objective is computed per sequence, as in the padded layout: each micro-batch carries, for each of its
`segments_per_row` sequence slots per row, the C completion positions of that sequence (`index`: where in its row
the logprob of completion token j sits) with the sequence's loss mask, behaviour logprobs, advantage and freshness
in the padded layout's completion window. The update gathers the row logprobs into that [slots, C] layout and runs
the same loss (loss.py) with the minibatch's normalisers, so every aggregation, GSPO's sequence ratio, the KL and
TIS terms and every statistic come out as the padded step's.

Sequences with nothing in the loss (an empty completion, or one masked out by algo.overlong=filter) add nothing to
the loss, its gradient or any statistic, so they are left out of the rows.

This is the update's only layout: trainer.packing=false is the case of one segment a row (`segments_per_row` 1,
each sequence alone in its row from index 0), the padded layout's compute through the same code. A step's batch is
packed here, on the host in numpy, once (`pack_batch`), and placed on the mesh once (packed_update.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from flax import struct


@dataclasses.dataclass(frozen=True)
class PackingLayout:
    """The shapes of the packed update: rows of `row_tokens` = P + C tokens, `rows` rows per pass,
    `segments_per_row` sequence slots per row, and room for `passes` passes a minibatch (enough for one sequence a
    row: a minibatch of more sequences than the configured one gets more); `prompt_tokens` = P locates the
    completion window of the padded layout."""

    prompt_tokens: int
    row_tokens: int
    rows: int
    segments_per_row: int
    passes: int = 1

    @property
    def completion_tokens(self) -> int:
        return self.row_tokens - self.prompt_tokens


def segments_per_row(row_tokens: int) -> int:
    """Sequence slots of one row: enough for rows of short sequences (one every 64 tokens, at least 4), at most one
    per 2 tokens (a sequence in the loss has a prompt token and a completion token) and at most 64. A row whose slots
    are full is closed even with tokens to spare; each slot costs C floats per per-token array, far below the
    vocabulary-wide logits of the row's tokens."""
    return max(1, min(64, row_tokens // 2, max(4, row_tokens // 64)))


def rows_per_micro_batch(tokens_per_micro_batch: int | None, micro_batch_size: int | None, minibatch: int,
                         row_tokens: int, data_parallel: int) -> int:
    """Rows of one packed forward/backward pass: tokens_per_micro_batch // row_tokens when set, else
    micro_batch_size (the padded layout's sequences per pass: the same activation memory), else a quarter of the
    minibatch's sequences; at most the minibatch's sequences, then rounded up to a multiple of the data-parallel size
    so every device gets whole rows."""
    if tokens_per_micro_batch is not None:  # at least one row: the config schema refuses less
        rows = max(1, tokens_per_micro_batch // row_tokens)
    else:
        rows = micro_batch_size if micro_batch_size is not None else max(1, math.ceil(minibatch / 4))
    # every row holds at least one sequence, so rows past the minibatch's count are always empty, yet each pass
    # computes them as full ones: a generous token budget on a small minibatch (1M tokens of 42-token rows: 23,809
    # rows for 128 sequences) multiplied the update's compute and activation memory for nothing
    rows = min(rows, max(1, minibatch))
    return data_parallel * math.ceil(rows / data_parallel)


def one_sequence_per_row(prompt_tokens: int, row_tokens: int, rows: int, sequences: int) -> PackingLayout:
    """The layout of trainer.packing=false: every sequence alone in its row of `row_tokens`, passes of `rows` rows,
    room for a minibatch of `sequences`."""
    return PackingLayout(prompt_tokens, row_tokens, rows, 1, math.ceil(sequences / rows))


def packing_layout(cfg, data_parallel: int, arch=None) -> PackingLayout:
    """The layout of the update of `cfg` (a RunConfig) on a mesh with `data_parallel` fsdp devices. With
    trainer.packing=false one sequence a row (`one_sequence_per_row`), trainer.micro_batch_size rows a pass (null:
    the whole minibatch), as the padded layout's passes were. `arch` (the model's Architecture), when known, is
    checked: Gemma 2's Tunix code places its sliding window by each token's position against its index in the row,
    which holds in a row of several sequences only when rows are no longer than the window (alone in its row, a
    sequence starts at index 0: its positions are its indices)."""
    t, gen = cfg.trainer, cfg.generation
    row = gen.max_prompt_tokens + gen.max_new_tokens
    minibatch = t.groups_per_step * gen.num_generations // cfg.algo.minibatches
    if not t.packing:
        rows = rows_per_micro_batch(None, t.micro_batch_size or minibatch, minibatch, row, data_parallel)
        return one_sequence_per_row(gen.max_prompt_tokens, row, rows, minibatch)
    window = getattr(arch, "sliding_window", None)
    if arch is not None and arch.family == "gemma2" and window is not None and row > window:
        raise ValueError(f"trainer.packing: Gemma 2's sliding window of {window} tokens is shorter than a packed row "
                         f"of {row} (generation.max_prompt_tokens + max_new_tokens); set trainer.packing=false "
                         "(one sequence a row)")
    rows = rows_per_micro_batch(t.tokens_per_micro_batch, t.micro_batch_size, minibatch, row, data_parallel)
    return PackingLayout(gen.max_prompt_tokens, row, rows, segments_per_row(row), math.ceil(minibatch / rows))


@struct.dataclass
class PackedPasses:
    """A minibatch's packed passes, stacked: [K, m, ...] for K = PackingLayout.passes passes of m rows of T tokens,
    S slots a row; the first `count` passes hold the sequences, the rest are never computed. Per-token inputs stay
    in row layout (compact whatever S); slot (r, s) is the s-th sequence of row r, its completion token j's logprob
    at row position starts[r, s] + j for j < lengths[r, s] (an empty slot has length 0)."""

    tokens: np.ndarray      # [K, m, T] int32, pad where no segment
    positions: np.ndarray   # [K, m, T] int32, 0 at each segment's first token
    segments: np.ndarray    # [K, m, T] int32, s + 1 on the tokens of slot s, 0 on padding
    loss_mask: np.ndarray   # [K, m, T - 1] float32 at the logprob positions of the completion tokens
    behaviour: np.ndarray   # [K, m, T - 1] float32, sampler logprobs at the same positions
    starts: np.ndarray      # [K, m, S] int32
    lengths: np.ndarray     # [K, m, S] int32
    advantages: np.ndarray  # [K, m, S] float32
    fresh: np.ndarray       # [K, m, S] float32


@dataclasses.dataclass
class PackedMinibatch:
    """A minibatch as packed passes (`count` of them in use), the minibatch's loss normalisers (masked tokens,
    sequences with any) and which sequence of the minibatch each slot holds ([K, m, S], -1: empty)."""

    passes: PackedPasses
    count: int
    normalizers: tuple[float, float]
    sources: np.ndarray

    def real_tokens(self) -> int:
        return int((self.passes.segments[:self.count] > 0).sum())

    def laid_out_tokens(self) -> int:
        return int(self.passes.segments[:self.count].size)


def first_fit_decreasing(lengths: np.ndarray, capacity: int, slots: int) -> list[list[int]]:
    """Rows of sequence indices: longest first, each into the first row with room for its tokens and a free slot.
    Deterministic (ties by index), so every trainer process packs a batch alike. Plain Python lists: for a step's
    few hundred sequences a scan of them is faster than numpy's per-call overhead (the packing is host time of
    every step)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"a sequence of {n} tokens does not fit a packed row of {capacity}")
        r = next((r for r in range(len(rows)) if room[r] >= n and len(rows[r]) < slots), len(rows))
        if r == len(rows):
            rows.append([])
            room.append(capacity)
        rows[r].append(i)
        room[r] -= n
    return rows


def pack_minibatch(tokens: np.ndarray, valid: np.ndarray, loss_mask: np.ndarray, behaviour: np.ndarray,
                   advantages: np.ndarray, fresh: np.ndarray, layout: PackingLayout, pad_id: int) -> PackedMinibatch:
    """Pack one minibatch given in the padded layout ([N, T] tokens and valid, [N, T - 1] loss mask and behaviour
    logprobs, [N] advantages and freshness) into passes of `layout.rows` rows; at least one pass, so a minibatch
    with nothing in the loss runs the same program (which then leaves the weights and optimizer state as they
    are)."""
    p, c = layout.prompt_tokens, layout.completion_tokens
    n, t = tokens.shape
    if t != layout.row_tokens:
        raise ValueError(f"batch rows of {t} tokens, packed layout of {layout.row_tokens}")
    if loss_mask[:, :p - 1].any():
        raise ValueError("the loss mask covers prompt positions; packing keeps only the completion window")
    prompt_len = valid[:, :p].sum(axis=1)
    completion_len = valid[:, p:].sum(axis=1)
    if (loss_mask[:, p - 1:] * (np.arange(c)[None, :] >= completion_len[:, None])).any():
        raise ValueError("the loss mask covers positions past a sequence's completion")
    live = np.flatnonzero(loss_mask.sum(axis=1) > 0)
    rows = [[int(live[i]) for i in row] for row in
            first_fit_decreasing((prompt_len + completion_len)[live], t, layout.segments_per_row)]
    count = max(1, math.ceil(len(rows) / layout.rows))
    k, m, s = max(layout.passes, count), layout.rows, layout.segments_per_row
    out = PackedPasses(tokens=np.full((k * m, t), pad_id, np.int32), positions=np.zeros((k * m, t), np.int32),
                       segments=np.zeros((k * m, t), np.int32), loss_mask=np.zeros((k * m, t - 1), np.float32),
                       behaviour=np.zeros((k * m, t - 1), np.float32), starts=np.zeros((k * m, s), np.int32),
                       lengths=np.zeros((k * m, s), np.int32), advantages=np.zeros((k * m, s), np.float32),
                       fresh=np.zeros((k * m, s), np.float32))
    sources = np.full((k * m, s), -1, np.int64)
    # every placed sequence's (row, slot, index) and where it starts in its row; then each array is filled with one
    # fancy-indexed assignment (vectorised: the packing is host time of every step)
    row_of = np.array([r for r, row in enumerate(rows) for _ in row], np.int64)
    slot_of = np.array([slot for row in rows for slot in range(len(row))], np.int64)
    seq = np.array([i for row in rows for i in row], np.int64)
    plen, clen = prompt_len[seq], completion_len[seq]
    span = plen + clen
    start = np.cumsum(span) - span  # where each sequence starts in all the rows' sequences, one after another
    offset = start - start[np.searchsorted(row_of, row_of)]  # ... and in its own row (row_of ascends)
    # the sequence's tokens: the valid span of its padded row (left-padded prompt, then completion)
    token = np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span)  # index within its sequence
    at_row, at_seq = np.repeat(row_of, span), np.repeat(seq, span)
    at_col = np.repeat(offset, span) + token
    out.tokens[at_row, at_col] = tokens[at_seq, np.repeat(p - plen, span) + token]
    out.positions[at_row, at_col] = token
    out.segments[at_row, at_col] = np.repeat(slot_of + 1, span)
    # completion token j sits at offset + plen + j; the logprob that predicts it at one before, as the padded row's
    # at p + j - 1
    first = offset + plen - 1
    j = np.arange(int(clen.sum())) - np.repeat(np.cumsum(clen) - clen, clen)
    c_row, c_col, c_seq = np.repeat(row_of, clen), np.repeat(first, clen) + j, np.repeat(seq, clen)
    out.loss_mask[c_row, c_col] = loss_mask[c_seq, p - 1 + j]
    out.behaviour[c_row, c_col] = behaviour[c_seq, p - 1 + j]
    out.starts[row_of, slot_of], out.lengths[row_of, slot_of] = first, clen
    out.advantages[row_of, slot_of], out.fresh[row_of, slot_of] = advantages[seq], fresh[seq]
    sources[row_of, slot_of] = seq
    norm = (float(loss_mask.sum()), float(len(live)))
    stacked = PackedPasses(**{f.name: getattr(out, f.name).reshape(k, m, *getattr(out, f.name).shape[1:])
                              for f in dataclasses.fields(out)})
    return PackedMinibatch(stacked, count, norm, sources.reshape(k, m, s))


@dataclasses.dataclass
class PackedBatch:
    """A step's batch packed on the host: `minibatches[k]` holds minibatch k (the batch's rows k * sequences ..
    (k + 1) * sequences - 1), and `loss_mask` is the batch's own ([B, T - 1], the padded layout), which the
    off-policy diagnostics read the per-token o - b against."""

    layout: PackingLayout
    minibatches: list[PackedMinibatch]
    sequences: int
    loss_mask: np.ndarray

    def real_tokens(self) -> int:
        return sum(p.real_tokens() for p in self.minibatches)

    def laid_out_tokens(self) -> int:
        return sum(p.laid_out_tokens() for p in self.minibatches)

    def scatter(self, k: int, rows: np.ndarray, out: np.ndarray) -> None:
        """Minibatch k's per-token values in its packed rows (`rows`: [passes, m, T - 1], as the update returns its
        o - b) into the batch's [B, T - 1] `out`: each sequence's completion positions at its own row of `out`, from
        position P - 1 (the rest of `out` is left as it is)."""
        mb, p = self.minibatches[k], self.layout.prompt_tokens
        kk, r, s = np.nonzero(mb.sources >= 0)
        n = mb.passes.lengths[kk, r, s].astype(np.int64)
        j = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)  # completion token index within its sequence
        at = lambda x: np.repeat(x, n)  # noqa: E731 - per slot -> per completion token
        out[at(k * self.sequences + mb.sources[kk, r, s]), p - 1 + j] = rows[at(kk), at(r),
                                                                             at(mb.passes.starts[kk, r, s]) + j]


def pack_batch(batch, layout: PackingLayout, minibatches: int, pad_id: int) -> PackedBatch:
    """`batch` (a TrainBatch of host arrays, batching.py) packed in `minibatches` minibatches of its consecutive
    rows. Deterministic: every trainer process packs the step's batch alike."""
    fields = [np.asarray(x) for x in (batch.tokens, batch.valid, batch.loss_mask, batch.behaviour_logprobs,
                                      batch.advantages, batch.fresh)]
    size = fields[0].shape[0] // minibatches
    packs = [pack_minibatch(*(x[k * size:(k + 1) * size] for x in fields), layout, pad_id)
             for k in range(minibatches)]
    return PackedBatch(layout, packs, size, fields[2])
