"""The continuous engine's rows: one per request taken from a source (a turn of an episode, or a row of a fixed
request set), with its output buffers; copying each decode chunk's tokens out; handing an ended row back to its
source, or keeping its slot's cache when the request asks to be held (held_turns.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from grpo_stream.common.engine.base import Request

if TYPE_CHECKING:
    from grpo_stream.common.engine.continuous import SlotGroup


class RequestRows:
    """Mixed into ContinuousEngine: `_requests`, `_row_out`, `_row_base` and `_prompt_lens` are indexed by row. A row
    is recycled once its sequence is handed back and its slot no longer holds it, so a serve that lasts a sampler's
    life keeps as many rows as it has sequences in flight, not one per request it ever took."""

    def _reset_rows(self) -> None:
        self._requests: list[Request | None] = []
        self._row_out: list[tuple | None] = []
        self._row_base: list[int] = []
        self._prompt_lens = np.zeros((64,), np.int64)  # capacity doubles as rows are added
        self._free_rows: list[int] = []

    def _free_row(self, row: int) -> None:
        self._requests[row], self._row_out[row] = None, None
        self._free_rows.append(row)

    def _register(self, request: Request, versions: bool) -> int:
        """A row for a request taken from the source: its output buffers, and its prompt length for the windows."""
        if not 0 < len(request.ids) < self.cache_len or not 1 <= request.budget <= self.max_new_tokens or \
                len(request.ids) + request.budget > self.cache_len:
            raise ValueError(f"request of {len(request.ids)} prompt tokens and a budget of {request.budget} does not "
                             f"fit the cache of {self.cache_len} positions (generation.max_prompt_tokens + "
                             "generation.max_new_tokens)")
        size = request.budget + (len(request.forced) if request.resume is not None and request.forced else 0)
        out = (np.full(size, self.pad_id, np.int32), np.zeros(size, np.float32),
               np.full(size, -1, np.int32) if versions else None)
        if self._free_rows:
            row = self._free_rows.pop()
            self._requests[row], self._row_out[row], self._row_base[row] = request, out, 0
        else:
            row = len(self._requests)
            self._requests.append(request)
            self._row_out.append(out)
            self._row_base.append(0)
            if row >= len(self._prompt_lens):
                self._prompt_lens = np.concatenate([self._prompt_lens, np.zeros_like(self._prompt_lens)])
        self._prompt_lens[row] = len(request.ids)
        return row

    def _collect(self, group: SlotGroup, toks, lps, now_produced, active, steps, version: int, ragged: bool):
        """Copy a chunk's new tokens out and free the slots whose sequence ended (handing it to its source)."""
        live = group.live
        self.stats["slot_steps"] += int(steps) * group.size
        self.stats["cache_positions_read"] += int(steps) * group.size * group.window
        if ragged:  # the step that samples token j of a row with prompt P attends over P + j + 1 positions; idle: 1
            first = self._prompt_lens[group.row[live]] + group.produced[live] + 1
            made = now_produced[live] - group.produced[live]
            read = int((made * first + made * (made - 1) // 2).sum())
            self.stats["attention_positions_read"] += read + int(steps) * group.size - int(made.sum())
        else:
            self.stats["attention_positions_read"] += int(steps) * group.size * group.window
        self.stats["live_slot_steps"] += int(now_produced[live].sum() - group.produced[live].sum())
        for s in np.flatnonzero(live):
            row, start, end = group.row[s], group.produced[s], now_produced[s]
            if self._row_out[row] is None:  # held: its turn ended, its cache waits for the next one
                continue
            base = self._row_base[row]
            tokens, logprobs, versions = self._row_out[row]
            tokens[start - base:end - base] = toks[s, :end - start]
            logprobs[start - base:end - base] = lps[s, :end - start]
            if end > start and versions is not None:
                versions[start - base] = group.logits_version[s]
                versions[start - base + 1:end - base] = version
                group.logits_version[s] = version
            group.produced[s] = end
            if not active[s]:
                finished = end > base and int(tokens[end - base - 1]) in self.eos_ids
                self._source_finish(row, end - base, finished)
                if self._requests[row].hold_key is None:
                    group.row[s] = -1
                    self._free_row(row)
                else:  # kept with its cache: the episode's next turn may resume it (held_turns.py)
                    self._drop_held(self._groups_now, self._requests[row].hold_key)  # an older hold: not resumed
                    self._held[self._requests[row].hold_key] = row

    def _source_finish(self, row: int, end: int, finished: bool) -> None:
        """Hand an ended row to its source; a resumed row's forced ids (fed from its cache) are not returned."""
        tokens, logprobs, versions = self._row_out[row]
        request = self._requests[row]
        skip = len(request.forced) if self._row_base[row] else 0  # resumed from a held cache
        self._source.finish(request, tokens[skip:end], logprobs[skip:end],
                            None if versions is None else versions[skip:end], finished)
        self._row_out[row] = None  # the source owns the arrays now
