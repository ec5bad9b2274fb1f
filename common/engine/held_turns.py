"""Holding a multi-turn episode's KV cache in its slot between turns (environment.kv_cache=hold).

When a request with a `hold_key` ends (its turn's stop token), its slot is not freed: the cache keeps the whole
conversation so far. When the episode's next turn arrives (`resume` = that key, `forced` = the observation's ids),
the slot is woken and fed the observation one token per decode step (slot_programs.py: forced tokens, no logprob)
while the other slots decode, then samples again: nothing is prefilled twice. A held slot still takes cache memory,
so when rows wait for slots and none is free, held slots are given up, oldest first; their episodes' next turns are
then prefilled from the conversation's ids, which every request carries. The engine's source may also say which held
keys it will never resume (`released()`: the episode ended).
"""

from __future__ import annotations

import collections

import numpy as np

from grpo_stream.common.engine.request_rows import RequestRows
from grpo_stream.common.engine.slot_programs import SlotPrograms
from grpo_stream.common.engine.slot_table import SlotGroup, SlotTable


class HeldTurns:
    """The held slots of one serve: hold key -> the row whose slot keeps its cache, oldest first. Frees and wakes
    slots of `table` and rows of `rows`; `programs` and `stats` are the engine's record of compiled shapes and its
    counters."""

    def __init__(self, table: SlotTable, rows: RequestRows, device: SlotPrograms, programs: set,
                 stats: collections.Counter):
        self.table, self.rows, self.device, self.programs, self.stats = table, rows, device, programs, stats
        self._held: dict = {}

    def clear(self) -> None:
        self._held.clear()

    def keep(self, key, row: int) -> None:
        """`row` ended and keeps its slot's cache under `key` (an older hold of the key is given up: not resumed)."""
        self._drop(key)
        self._held[key] = row

    def _drop(self, key) -> None:
        row = self._held.pop(key, None)
        if row is not None:
            group, slot = self.table.locate(row)
            if group is not None:
                group.row[slot] = -1
                self.stats["held_given_up"] += 1
            self.rows.free(row)

    def release(self, keys: list) -> None:
        """Free the held slots of episodes that ended (`keys`: the source's `released()`)."""
        for key in keys:
            row = self._held.pop(key, None)
            group, slot = self.table.locate(row) if row is not None else (None, None)
            if group is not None:
                group.row[slot] = -1
            if row is not None:
                self.rows.free(row)

    def evict(self, waiting: int) -> None:
        """Give up held slots, oldest first, while `waiting` rows wait and no slot is free for them."""
        while self._held:
            if self.table.slots - self.table.live_count() >= waiting:  # the main group can grow into the slots left
                return
            self._drop(next(iter(self._held)))

    def resume(self, requests: list, versioned: bool) -> list:
        """Wake the held slots the requests continue; returns the requests to prefill (not held, or given up)."""
        rest, woken = [], {}
        for request in requests:
            row = self._held.get(request.resume) if request.resume is not None else None
            group, slot = self.table.locate(row) if row is not None else (None, None)
            if group is None or not request.forced or len(request.forced) > self.device.max_forced:
                if row is not None:
                    self._drop(request.resume)
                rest.append(request)
                continue
            del self._held[request.resume]
            group.row[slot] = self.rows.register_resumed(request, versioned, row, int(group.produced[slot]))
            woken.setdefault(id(group), (group, []))[1].append((slot, request))
        for group, items in woken.values():
            self._wake(group, items)
        return rest

    def _wake(self, group: SlotGroup, items: list) -> None:
        size, max_forced = group.size, self.device.max_forced
        slots = np.full((size,), size, np.int32)
        forced = np.zeros((size, max_forced), np.int32)
        counts, budgets = np.zeros((size,), np.int32), np.zeros((size,), np.int32)
        keys = np.zeros((size, *np.shape(items[0][1].key)), np.uint32)
        greedy = np.zeros((size,), np.bool_)
        for i, (slot, request) in enumerate(items):
            slots[i], counts[i], keys[i], greedy[i] = slot, len(request.forced), request.key, request.greedy
            forced[i, :counts[i]] = request.forced
            budgets[i] = int(group.produced[slot]) + counts[i] + request.budget
        self.programs.add(("resume", size))
        group.state = self.device.resume(group.state, slots, forced, counts, budgets, keys, greedy)
        self.stats["resumed_turns"] += len(items)
        self.stats["forced_tokens"] += int(counts.sum())
