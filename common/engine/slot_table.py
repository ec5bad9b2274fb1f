"""The continuous engine's slot table: its one or two slot groups, their sizes and windows.

The main group holds every admitted row until one outgrows its window; with length_groups=2 such a row may move to
a second, long-window group instead (continuous.py's docstring tells why and when). `SlotTable` owns the groups:
it grows the main group for waiting rows, fits each group's window to the coming chunk (widen, move or merge, by
`step_cost`), and shrinks groups down the slot ladder as they empty. Per slot it knows which row the slot serves;
the rows themselves (prompt lengths, outputs) are request_rows.py's.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses

import jax.numpy as jnp
import numpy as np

from grpo_stream.common.engine.slot_programs import MIN_SLOTS, MIN_WINDOW, SlotPrograms, SlotState, slot_ladder


@dataclasses.dataclass
class SlotGroup:
    """The host's view of one slot group: its device state and, per slot, the row it serves."""
    state: SlotState
    window: int
    row: np.ndarray             # row each slot serves, -1: free
    produced: np.ndarray        # completion tokens copied out so far
    logits_version: np.ndarray  # version of the weights that computed the slot's next-token logits

    @property
    def size(self) -> int:
        return len(self.row)

    @property
    def live(self) -> np.ndarray:
        return self.row >= 0


def step_cost(layout: list[tuple[int, int]], row_work: float) -> float:
    """Relative cost of one decode step over slot groups of (slots, window), in units of one slot attending over
    one cache position: every slot pays `row_work` (its share of the weight matmuls and sampling) and its window.
    The groups share one weight pass per step, so a second group costs only its own slots."""
    return sum(size * (row_work + window) for size, window in layout)


class SlotTable:
    """The main and long slot groups of one serve (`main` None before the first row, `long` None while no row needs
    it). `programs` and `stats` are the engine's record of compiled shapes and its counters."""

    def __init__(self, device: SlotPrograms, slots: int, length_groups: int, cache_len: int, row_work: float,
                 programs: set, stats: collections.Counter):
        self.device, self.slots, self.length_groups, self.cache_len = device, slots, length_groups, cache_len
        self.row_work = row_work  # the cost model's work of a row outside attention, in cache positions
        self.ladder = slot_ladder(slots)
        self.programs, self.stats = programs, stats
        self.main: SlotGroup | None = None
        self.long: SlotGroup | None = None

    def clear(self) -> None:
        self.main = self.long = None

    @property
    def groups(self) -> tuple[SlotGroup | None, SlotGroup | None]:
        return self.main, self.long

    def live_count(self) -> int:
        """Slots serving a row (decoding or held) in both groups."""
        return sum(int(g.live.sum()) for g in (self.main, self.long) if g is not None)

    def locate(self, row: int) -> tuple[SlotGroup | None, int | None]:
        """The group and slot serving `row`, or (None, None)."""
        for group in (self.main, self.long):
            if group is not None:
                slots = np.flatnonzero(group.row == row)
                if slots.size:
                    return group, int(slots[0])
        return None, None

    def size_for(self, n: int, low: int = 1) -> int:
        """The smallest slot count on the ladder holding n sequences (at least `low`, at most `slots`)."""
        return self.ladder[min(bisect.bisect_left(self.ladder, max(n, low)), len(self.ladder) - 1)]

    def grow(self, waiting: int) -> None:
        """The main group grows to hold `waiting` rows beside its live ones (a fixed request set: sized once, at the
        start)."""
        main = self.main
        need = self.size_for(min(self.slots, (int(main.live.sum()) if main else 0) + waiting))
        self.main = self._group(need, MIN_WINDOW) if main is None else self._regroup(main, max(need, main.size))

    def shrink(self, waiting: bool) -> None:
        """After a chunk: drop an empty long group (or let it carry on alone as the main one), and while no row
        waits, take each group one step down the slot ladder if its live sequences fit there."""
        main, long = self.main, self.long
        if long is not None and not long.live.any():
            long = None
        if long is not None and not main.live.any() and not waiting:
            main, long = long, None  # only long sequences are left: their group carries on alone
        if not waiting:
            main = self._shrink(main)
        self.main, self.long = main, (self._shrink(long) if long is not None else None)

    # ---- windows ---------------------------------------------------------------------------------------------

    def _need(self, tokens: np.ndarray | int) -> np.ndarray:
        """The window that holds sequences of `tokens` tokens to the end of the coming chunk."""
        buckets = np.maximum(MIN_WINDOW, 2 ** np.ceil(np.log2(np.asarray(tokens) + self.device.chunk_steps)))
        return np.minimum(self.cache_len, buckets).astype(np.int64)

    def _needs(self, group: SlotGroup, prompt_lens: np.ndarray) -> np.ndarray:
        """Per slot: the window its sequence needs this chunk (0 for a free slot)."""
        lengths = prompt_lens[np.maximum(group.row, 0)] + group.produced
        return np.where(group.live, self._need(lengths), 0)

    def fit_windows(self, prompt_lens: np.ndarray, coming: list[int]) -> None:
        """Give every group the window its sequences need this chunk (`prompt_lens`: per row; `coming`: the rows
        about to be admitted). Main-group sequences that outgrow its window either widen it or move to the long
        group, whichever `step_cost` says is cheaper within the memory of `slots` whole sequences; when neither
        fits, the groups merge."""
        main, long = self.main, self.long
        long_window = max(MIN_WINDOW, int(self._needs(long, prompt_lens).max())) if long is not None else 0
        needs = self._needs(main, prompt_lens)
        coming_need = int(self._need(prompt_lens[coming]).max()) if coming else MIN_WINDOW
        outgrown = np.flatnonzero(needs > main.window)
        keep = max(coming_need, int(needs[needs <= main.window].max(initial=MIN_WINDOW)))
        widen = max(keep, int(needs.max(initial=0)))
        others = [(long.size, long_window)] if long is not None else []
        layouts = {"widen": [(main.size, widen)] + others}
        if outgrown.size and self.length_groups > 1:
            long_live = int(long.live.sum()) if long is not None else 0
            size = max(long.size if long is not None else 0, self.size_for(long_live + outgrown.size, MIN_SLOTS))
            if size <= self.slots:
                layouts["move"] = [(main.size, keep), (size, max(long_window, int(needs[outgrown].max())))]
        budget = self.slots * self.cache_len
        feasible = {k: v for k, v in layouts.items() if sum(s * w for s, w in v) <= budget}
        if not feasible:  # one group of every live sequence always fits: at most `slots` are live
            self.main, self.long = self._merge(main, long, max(widen, long_window)), None
            return
        choice = min(feasible, key=lambda k: step_cost(feasible[k], self.row_work))
        if choice == "widen":
            self.main = self._set_window(main, widen)
            self.long = self._set_window(long, long_window) if long is not None else None
            return
        size, window = layouts["move"][1]
        long = self._group(size, window) if long is None else self._regroup(self._set_window(long, window), size)
        self._transfer(main, long, outgrown, np.flatnonzero(~long.live)[:outgrown.size])
        self.main, self.long = self._set_window(main, keep), long

    # ---- groups ----------------------------------------------------------------------------------------------

    def _group(self, size: int, window: int) -> SlotGroup:
        self.programs.add(("empty", size, window))
        return SlotGroup(self.device.empty(size=size, window=window), window, np.full(size, -1, np.int64),
                         np.zeros(size, np.int64), np.zeros(size, np.int64))

    def _set_window(self, group: SlotGroup, window: int) -> SlotGroup:
        if window != group.window:
            self.programs.add(("resize", group.size, group.window, window))
            group.state, group.window = self.device.resize(group.state, window=window), window
        return group

    def _regroup(self, group: SlotGroup, size: int) -> SlotGroup:
        """`group` with `size` slots (at least its live ones), its live sequences moved in."""
        if size == group.size:
            return group
        bigger = self._group(size, group.window)
        live = np.flatnonzero(group.live)
        self._transfer(group, bigger, live, np.arange(live.size))
        return bigger

    def _merge(self, main: SlotGroup, long: SlotGroup | None, window: int) -> SlotGroup:
        """One group holding every live sequence at `window`."""
        main = self._set_window(main, window)
        if long is None:
            return main
        total = int(main.live.sum() + long.live.sum())
        main = self._regroup(main, max(main.size, self.size_for(total)))
        self._transfer(long, main, np.flatnonzero(long.live), np.flatnonzero(~main.live)[:int(long.live.sum())])
        self.stats["merges"] += 1
        return main

    def _transfer(self, src: SlotGroup, dst: SlotGroup, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """Move sequences from src slots to free dst slots, on the device and in the host's bookkeeping."""
        n, width = len(src_slots), min(src.size, dst.size)
        assert len(dst_slots) == n <= width, "not enough free slots to move into"
        src_idx, dst_idx = np.full(width, src.size, np.int32), np.full(width, dst.size, np.int32)
        src_idx[:n], dst_idx[:n] = src_slots, dst_slots
        self.programs.add(("move", src.size, src.window, dst.size, dst.window))
        dst.state, active = self.device.move(src.state, dst.state, jnp.asarray(src_idx), jnp.asarray(dst_idx))
        src.state = src.state.replace(active=active)
        for name in ("row", "produced", "logits_version"):
            getattr(dst, name)[dst_slots] = getattr(src, name)[src_slots]
        src.row[src_slots] = -1
        self.stats["moved_rows"] += n

    def _shrink(self, group: SlotGroup) -> SlotGroup:
        """The group one step down the slot ladder (not below MIN_SLOTS) if its live sequences fit there, else as
        it is. One step per chunk, not a jump to the smallest size that fits, keeps the compiled shapes to one
        chain (S, ..., 12, 8)."""
        i = bisect.bisect_left(self.ladder, group.size)
        new_size = self.ladder[i - 1] if i > 0 and self.ladder[i] == group.size else 0
        if new_size < MIN_SLOTS or group.live.sum() > new_size:
            return group
        live = np.flatnonzero(group.live)
        order = np.concatenate([live, np.flatnonzero(~group.live)]).astype(np.int32)
        self.programs.add(("compact", group.size, group.window, new_size))
        state = self.device.compact(group.state, jnp.asarray(order), size=new_size)
        keep = order[:new_size]
        return SlotGroup(state, group.window, group.row[keep].copy(), group.produced[keep].copy(),
                         group.logits_version[keep].copy())
