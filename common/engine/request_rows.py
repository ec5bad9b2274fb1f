"""The continuous engine's rows: one per request taken from a source (a turn of an episode, or a row of a fixed
request set), with its output buffers; copying each decode chunk's tokens out; handing an ended row back to its
source, or keeping its slot's cache when the request asks to be held (held_turns.py)."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import numpy as np

from grpo_stream.common.engine.base import Request, RequestSource, check_served
from grpo_stream.common.engine.slot_table import SlotGroup

if TYPE_CHECKING:
    from grpo_stream.common.engine.held_turns import HeldTurns


class RequestRows:
    """The rows of one serve: `requests`, `out` (tokens, logprobs, versions), `base` (completion tokens produced
    before the row's turn: a resumed held cache's) and `prompt_lens` are indexed by row. A row is recycled once its
    sequence is handed back and its slot no longer holds it, so a serve that lasts a sampler's life keeps as many
    rows as it has sequences in flight, not one per request it ever took."""

    def __init__(self, pad_id: int, eos_ids: tuple[int, ...], cache_len: int, max_new_tokens: int, vocab_size: int,
                 stats: collections.Counter, context_field: str):
        """`context_field`: the setting that sized the cache (`cache_len` positions per sequence), named when a
        request does not fit it; `vocab_size`: the model's embedding rows, which every id must name."""
        self.pad_id, self.eos_ids, self.cache_len, self.max_new_tokens = pad_id, eos_ids, cache_len, max_new_tokens
        self.vocab_size = vocab_size
        self.stats, self.context_field = stats, context_field
        self.reset(None)

    def reset(self, source: RequestSource | None) -> None:
        """No rows; ended ones go back to `source`."""
        self.source = source
        self.requests: list[Request | None] = []
        self.out: list[tuple | None] = []   # None: handed back (or held: its turn ended, its cache waits)
        self.base: list[int] = []
        self.prompt_lens = np.zeros((64,), np.int64)  # capacity doubles as rows are added
        self._free: list[int] = []

    def free(self, row: int) -> None:
        self.requests[row], self.out[row] = None, None
        self._free.append(row)

    def register(self, request: Request, versions: bool) -> int:
        """A row for a request taken from the source: its output buffers, and its prompt length for the windows."""
        check_served(request, self.max_new_tokens, self.cache_len, self.vocab_size, self.context_field)
        size = request.budget + (len(request.forced) if request.resume is not None and request.forced else 0)
        out = (np.full(size, self.pad_id, np.int32), np.zeros(size, np.float32),
               np.full(size, -1, np.int32) if versions else None)
        if self._free:
            row = self._free.pop()
            self.requests[row], self.out[row], self.base[row] = request, out, 0
        else:
            row = len(self.requests)
            self.requests.append(request)
            self.out.append(out)
            self.base.append(0)
            if row >= len(self.prompt_lens):
                self.prompt_lens = np.concatenate([self.prompt_lens, np.zeros_like(self.prompt_lens)])
        self.prompt_lens[row] = len(request.ids)
        return row

    def register_resumed(self, request: Request, versions: bool, held_row: int, produced: int) -> int:
        """A row for a request that continues the held row `held_row`, whose slot has produced `produced` completion
        tokens (its sequence's prompt is the held one's); the held row is freed."""
        row = self.register(request, versions)
        self.prompt_lens[row] = self.prompt_lens[held_row]
        self.base[row] = produced  # > 0: a turn produced tokens before it was held
        self.free(held_row)
        return row

    def decoding(self, group: SlotGroup | None) -> int:
        """Live slots of `group` that are decoding or about to (not held idle)."""
        if group is None:
            return 0
        return sum(1 for row in group.row[group.live] if self.out[row] is not None)

    def collect(self, group: SlotGroup, toks, lps, now_produced, active, steps, version: int, ragged: bool,
                held: HeldTurns) -> None:
        """Copy a chunk's new tokens out and free the slots whose sequence ended (handing it to its source), or
        keep them in `held` when their request asks."""
        live = group.live
        self.stats["slot_steps"] += int(steps) * group.size
        self.stats["cache_positions_read"] += int(steps) * group.size * group.window
        if ragged:  # the step that samples token j of a row with prompt P attends over P + j + 1 positions; idle: 1
            first = self.prompt_lens[group.row[live]] + group.produced[live] + 1
            made = now_produced[live] - group.produced[live]
            read = int((made * first + made * (made - 1) // 2).sum())
            self.stats["attention_positions_read"] += read + int(steps) * group.size - int(made.sum())
        else:
            self.stats["attention_positions_read"] += int(steps) * group.size * group.window
        self.stats["live_slot_steps"] += int(now_produced[live].sum() - group.produced[live].sum())
        for s in np.flatnonzero(live):
            row, start, end = group.row[s], group.produced[s], now_produced[s]
            if self.out[row] is None:  # held: its turn ended, its cache waits for the next one
                continue
            base = self.base[row]
            tokens, logprobs, versions = self.out[row]
            tokens[start - base:end - base] = toks[s, :end - start]
            logprobs[start - base:end - base] = lps[s, :end - start]
            if end > start and versions is not None:
                versions[start - base] = group.logits_version[s]
                versions[start - base + 1:end - base] = version
                group.logits_version[s] = version
            group.produced[s] = end
            if not active[s]:
                finished = end > base and int(tokens[end - base - 1]) in self.eos_ids
                self._hand_back(row, end - base, finished)
                if self.requests[row].hold_key is None:
                    group.row[s] = -1
                    self.free(row)
                else:  # kept with its cache: the episode's next turn may resume it (held_turns.py)
                    held.keep(self.requests[row].hold_key, row)

    def _hand_back(self, row: int, end: int, finished: bool) -> None:
        """Hand an ended row to its source; a resumed row's forced ids (fed from its cache) are not returned."""
        tokens, logprobs, versions = self.out[row]
        request = self.requests[row]
        skip = len(request.forced) if self.base[row] else 0  # resumed from a held cache
        self.source.finish(request, tokens[skip:end], logprobs[skip:end],
                           None if versions is None else versions[skip:end], finished)
        self.out[row] = None  # the source owns the arrays now
