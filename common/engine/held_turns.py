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

import numpy as np


class HeldTurns:
    """The continuous engine's bookkeeping of held slots (mixed into ContinuousEngine)."""

    def _running(self, group) -> int:
        """Live slots that are decoding or about to (not held idle)."""
        if group is None:
            return 0
        return sum(1 for row in group.row[group.live] if self._row_out[row] is not None)

    def _locate(self, groups, row: int):
        for group in groups:
            if group is not None:
                slots = np.flatnonzero(group.row == row)
                if slots.size:
                    return group, int(slots[0])
        return None, None

    def _drop_held(self, groups, key) -> None:
        row = self._held.pop(key, None)
        if row is not None:
            group, slot = self._locate(groups, row)
            if group is not None:
                group.row[slot] = -1
                self.stats["held_given_up"] += 1
            self._free_row(row)

    def _release_held(self, main, long, source) -> None:
        """Free the held slots whose episodes ended."""
        for key in source.released():
            row = self._held.pop(key, None)
            group, slot = self._locate((main, long), row) if row is not None else (None, None)
            if group is not None:
                group.row[slot] = -1
            if row is not None:
                self._free_row(row)

    def _evict_held(self, main, long, waiting: int) -> None:
        """Give up held slots, oldest first, while rows wait and no slot is free for them."""
        while self._held:
            live = (int(main.live.sum()) if main is not None else 0) + (int(long.live.sum()) if long is not None else 0)
            if self.slots - live >= waiting:  # the main group can grow into the slots left
                return
            self._drop_held((main, long), next(iter(self._held)))

    def _resume_held(self, main, long, requests: list, versioned: bool) -> list:
        """Wake the held slots the requests continue; returns the requests to prefill (not held, or given up)."""
        rest, woken = [], {}
        for request in requests:
            row = self._held.get(request.resume) if request.resume is not None else None
            group, slot = self._locate((main, long), row) if row is not None else (None, None)
            if group is None or not request.forced or len(request.forced) > self.max_forced:
                if row is not None:
                    self._drop_held((main, long), request.resume)
                rest.append(request)
                continue
            del self._held[request.resume]
            new = self._register(request, versioned)
            self._prompt_lens[new] = self._prompt_lens[row]
            self._row_base[new] = int(group.produced[slot])  # > 0: a turn produced tokens before it was held
            group.row[slot] = new
            self._free_row(row)
            woken.setdefault(id(group), (group, []))[1].append((slot, request))
        for group, items in woken.values():
            self._wake(group, items)
        return rest

    def _wake(self, group, items: list) -> None:
        size = group.size
        slots = np.full((size,), size, np.int32)
        forced = np.zeros((size, self.max_forced), np.int32)
        counts, budgets = np.zeros((size,), np.int32), np.zeros((size,), np.int32)
        keys = np.zeros((size, *np.shape(items[0][1].key)), np.uint32)
        greedy = np.zeros((size,), np.bool_)
        for i, (slot, request) in enumerate(items):
            slots[i], counts[i], keys[i], greedy[i] = slot, len(request.forced), request.key, request.greedy
            forced[i, :counts[i]] = request.forced
            budgets[i] = int(group.produced[slot]) + counts[i] + request.budget
        self.programs.add(("resume", size))
        group.state = self._resume(group.state, slots, forced, counts, budgets, keys, greedy)
        self.stats["resumed_turns"] += len(items)
        self.stats["forced_tokens"] += int(counts.sum())
