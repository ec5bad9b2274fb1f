"""The JAX sampling engine (sampler.engine: jax): continuous batching over a fixed set of decode slots.

A request set (`generate`'s prompts, one row each) is served by at most
`slots` decode slots, each holding one sequence's KV cache. The device runs
jitted chunks of up to `chunk_steps` decode steps (slot_programs.py; no host
round trip per token); at the chunk boundaries the host takes the new tokens,
frees the slots whose sequence ended (EOS or its token budget) and refills
them from the pending rows, while the other slots keep their caches and go on
decoding. A request set ends when its last sequence ends, never at
max_new_tokens for its own sake.

- Shared prompt prefill: identical prompts among the rows being admitted (the
  G completions of a GRPO group) are prefilled once; the prompt's keys and
  values are copied into each of their slots.
- Attention follows live lengths. Slots live in groups whose caches share a
  window W: the smallest length bucket (64, 128, 256, ... the longest sequence
  allowed) holding each of the group's sequences to the chunk's end, so a step
  at live length 100 reads 128 keys, not the whole cache. Windows change
  between chunks (rarely: buckets double), never inside one (a slice of the
  cache inside a chunk is a copy of it on every step). With
  `length_groups=2` a sequence that outgrows the main group's window can move
  to a second, long-window group instead of widening the window of every
  slot: in a long-tailed request set a few long completions would otherwise
  make hundreds of short ones attend over their length. The
  choice is made by a cost model (`step_cost`): every slot pays its row's
  work and its window; both groups decode in one program, one weight pass
  per step, the matmuls over all rows and attention per group. It is off by
  default: it cut the cache positions read by 11% without a measurable
  speed-up on CPU and compiles more programs (BENCHMARKS.md).
- Ragged attention on CPU: on one CPU device in float32 every slot reads
  only its own positions (cpu_attention.py: a C++ XLA FFI kernel over the
  same caches; the windows then bound memory, not reads). Elsewhere, or
  without a compiler, attention reads the group's window (an accelerator's
  ragged paged-attention kernel would go behind the same switch).
- The slot count follows the work: the main group has the smallest size on a
  ladder of slot counts (8, 12, 16, 24, 32, 48, ... at most `slots`) holding
  the request set, and once no row is pending and its live sequences fit the
  next size down, they are compacted into it (down to 8); the long group
  grows and shrinks the same way. KV memory stays within `slots` x the longest sequence: at most `slots`
  sequences are live at once, and a layout over that memory merges the two
  groups instead.
- Compiled programs: one per (slots, window) for decoding (each slot samples
  its own request's way, greedy or at the temperature), per
  (prompts, prompt-length bucket) for prefill, per group shapes for admission,
  compaction, resizing and moving; `programs` lists the shapes compiled.

Layout and numerics: a slot's prompt occupies cache slots 0..P-1 with RoPE
positions 0..P-1 and its completion follows, which is what the trainer's
left-padded layout gives the same tokens (`positions_from_mask`), so
behaviour logprobs equal the trainer's recomputation to float rounding. Each
row samples with its own key, fold_in(rng, row), and its n-th token with
fold_in(that, n): results do not depend on how rows were scheduled onto slots
or groups.

In-flight weight updates: `generate(..., refresh=f)` calls f() at every chunk
boundary; when it returns new (params, version) every live slot continues
with the new weights, and the keys and values of its earlier tokens, which
older weights computed, are kept (as PipelineRL does; recomputing them would
cost a prefill of every live sequence per update). `Generation.versions`
records per token the version whose weights computed the distribution it was
drawn from: token j of a completion was drawn from the logits of the forward
pass that fed token j-1 (the prompt's prefill for j = 0), and that pass also
wrote token j-1's key and value. So a token's recorded logprob is exactly
its version's given the cache as it was, and a completion can mix versions
(the oldest one bounds its staleness).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.engine import cpu_attention, decode
from grpo_stream.common.engine.side_requests import SideServing
from grpo_stream.common.engine.base import Generation, RequestSource, generate_by_serving
from grpo_stream.common.engine.held_turns import HeldTurns
from grpo_stream.common.engine.request_rows import RequestRows
from grpo_stream.common.engine.slot_programs import (MIN_SLOTS, MIN_WINDOW, SlotPrograms, SlotState, pow2_at_least,
                                                      slot_ladder)
from grpo_stream.common.model.policy import PolicyModel


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


class ContinuousEngine(SideServing, RequestRows, HeldTurns, SlotPrograms):
    """Generates completions for request sets of token-id prompts with continuous batching."""

    def __init__(self, model: PolicyModel, pad_id: int, eos_id: int | list[int], max_prompt_tokens: int,
                 max_new_tokens: int, temperature: float, slots: int = 256, chunk_steps: int = 16,
                 length_groups: int = 1, ragged_attention: bool = True):
        """`eos_id`: the stop token, or all of them; `slots`: most sequences decoded at once (KV-cache memory
        grows with it); `chunk_steps`: most decode steps between two host scheduling points; `length_groups`: 1
        (every slot attends over the longest live sequence's window) or 2 (long sequences may move to their own
        group); `ragged_attention`: on one CPU device in float32, attention reads each slot's own positions through
        the CPU kernel (cpu_attention.py) where it builds."""
        if slots < 1 or chunk_steps < 1 or length_groups not in (1, 2):
            raise ValueError(f"slots={slots} and chunk_steps={chunk_steps} must be >= 1, length_groups="
                             f"{length_groups} 1 or 2")
        eos_ids = tuple(eos_id) if isinstance(eos_id, (list, tuple)) else (eos_id,)
        super().__init__(model, pad_id, eos_ids, temperature, chunk_steps, max_forced=max_new_tokens)
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        self.slots, self.length_groups, self.ragged_attention = slots, length_groups, ragged_attention
        self.ladder = slot_ladder(slots)
        decode.check_sequence_fits(model, max_prompt_tokens + max_new_tokens)
        # a completion's last token is sampled, never written: the cache needs prompt + max_new_tokens - 1 slots
        self.cache_len = -(-(max_prompt_tokens + max_new_tokens) // MIN_WINDOW) * MIN_WINDOW
        arch = model.arch
        # a row's work outside attention in cache positions: the parameters over one position's keys and values
        # (2 x KV x D x layers numbers) is the ratio of their memory traffic; measured on CPU (bench sampler's
        # model: 1.0 ms per row and 1.1 us per position at 256 slots) the matmul side is 16x cheaper than that
        self.row_work = model.num_params() / (2 * arch.num_kv_heads * arch.head_dim * arch.num_layers) / 16
        self._relaid: tuple[Any, Any, bool] = (None, None, False)  # params, their decode layout, ragged

    def _weights(self, params: Any):
        """`params` laid out for decoding, made once per weight version, and whether its decode attention reads each
        slot's own positions (cpu_attention.py): float32 weights on one CPU device (a mesh of several would need the
        kernel partitioned) and the kernel built."""
        if self._relaid[0] is not params:
            self._relaid = (None, None, False)  # free the previous version's copy first
            weights = self._relayout(params)
            leaf = jax.tree_util.tree_leaves(weights)[0]
            devices = leaf.sharding.device_set
            ragged = (self.ragged_attention and leaf.dtype == jnp.float32 and len(devices) == 1
                      and next(iter(devices)).platform == "cpu" and cpu_attention.available())
            self._relaid = (params, weights, ragged)
        return self._relaid[1]

    def generate(self, params: Any, prompts: list[list[int]], rng: jax.Array, greedy: bool = False,
                 max_new_tokens: list[int] | None = None,
                 refresh: Callable[[], tuple[Any, int] | None] | None = None, version: int = 0) -> Generation:
        """Completions of `prompts` under `params` (weight version `version`); `max_new_tokens`: a per-row token
        budget (default generation.max_new_tokens for all); `refresh`: called at chunk boundaries, returns newer
        (params, version) to continue with, or None; with it, `Generation.versions` records each token's version."""
        return generate_by_serving(self, params, prompts, rng, greedy, max_new_tokens, refresh, version)

    def _serve(self, params: Any, source: RequestSource,
               refresh: Callable[[], tuple[Any, int] | None] | None = None, version: int = 0) -> None:
        """Decode the requests `source` hands out until it has none left and none will come (or it is cancelled):
        each chunk boundary takes the requests ready then (a multi-turn episode's next turn enters when its
        environment has answered, a sampler's next group when one ended, while the other slots keep decoding) and
        hands every ended sequence back through `source.finish`. A serve may last a sampler's life: rows are
        recycled once their sequence is handed back."""
        weights = self._weights(params)
        self._reset_rows()
        self._source = source
        self._held: dict = {}  # hold key -> the row whose slot keeps its cache
        main, long = None, None
        pending: collections.deque = collections.deque()
        while not source.cancelled():
            if refresh is not None:
                update = refresh()
                if update is not None:
                    params, version = update
                    weights = self._weights(params)
            self._release_held(main, long, source)
            taken = self._resume_held(main, long, source.take(), refresh is not None)
            pending.extend(self._register(r, refresh is not None) for r in taken)
            running = self._running(main) + self._running(long)
            if pending:  # the main group grows to hold what waits (a fixed request set: sized once, at the start)
                self._evict_held(main, long, len(pending))
                need = self._size_for(min(self.slots, (int(main.live.sum()) if main else 0) + len(pending)))
                main = self._group(need, MIN_WINDOW) if main is None else self._regroup(main, max(need, main.size))
            if not running and not pending:
                if not source.open():
                    self._held.clear()
                    return
                source.wait(0.5)
                continue
            live_total = int(main.live.sum()) + (int(long.live.sum()) if long else 0)
            coming = [pending[i] for i in range(min(int((~main.live).sum()), len(pending), self.slots - live_total))]
            main, long = self._fit_windows(main, long, coming)
            free = np.flatnonzero(~main.live)  # after fitting: a merge or regroup moves live sequences into slots
            coming = coming[:len(free)]
            if coming:
                admitted = self._admit_pending(weights, main, pending, free[:len(coming)])
                main.logits_version[admitted] = version
            if running or coming:
                self._decode_and_collect(weights, main, long, len(pending), version)
            main, long = self._compact_groups(main, long, pending)

    def _decode_and_collect(self, weights, main: SlotGroup, long: SlotGroup | None, waiting: int,
                            version: int) -> None:
        """One decode chunk over the live groups, its tokens copied out."""
        held = main.size * main.window + (long.size * long.window if long is not None else 0)
        self.stats["peak_cache_positions"] = max(self.stats["peak_cache_positions"], held)
        groups = [g for g in (main, long) if g is not None and g.live.any()]
        if groups[0] is main and waiting:  # stop early once enough slots are free for waiting rows
            want_free = int((~main.live).sum()) + min(waiting, max(1, main.size // 8))
        else:
            want_free = groups[0].size + 1
        windows, ragged = tuple(g.window for g in groups), self._relaid[2]
        self.programs.add(("decode", tuple((g.size, g.window) for g in groups), ragged))
        states, toks, lps, steps = self._decode(weights, tuple(g.state for g in groups), jnp.int32(want_free),
                                                windows=windows, ragged=ragged)
        fetched = jax.device_get((toks, lps, tuple((s.produced, s.active) for s in states), steps))
        self._groups_now = (main, long)
        for i, group in enumerate(groups):
            group.state = states[i]
            self._collect(group, fetched[0][i], fetched[1][i], *fetched[2][i], fetched[3], version, ragged)
        self.stats["decode_steps"] += int(fetched[3])


    # ---- windows and groups ----------------------------------------------------------------------------------

    def _need(self, tokens: np.ndarray | int) -> np.ndarray:
        """The window that holds sequences of `tokens` tokens to the end of the coming chunk."""
        buckets = np.maximum(MIN_WINDOW, 2 ** np.ceil(np.log2(np.asarray(tokens) + self.chunk_steps)))
        return np.minimum(self.cache_len, buckets).astype(np.int64)

    def _needs(self, group: SlotGroup) -> np.ndarray:
        """Per slot: the window its sequence needs this chunk (0 for a free slot)."""
        lengths = self._prompt_lens[np.maximum(group.row, 0)] + group.produced
        return np.where(group.live, self._need(lengths), 0)

    def _fit_windows(self, main: SlotGroup, long: SlotGroup | None, coming: list[int]):
        """Give every group the window its sequences need this chunk. Main-group sequences that outgrow its window
        either widen it or move to the long group, whichever `step_cost` says is cheaper within the memory of
        `slots` whole sequences; when neither fits, the groups merge."""
        long_window = max(MIN_WINDOW, int(self._needs(long).max())) if long is not None else 0
        needs = self._needs(main)
        coming_need = int(self._need(self._prompt_lens[coming]).max()) if coming else MIN_WINDOW
        outgrown = np.flatnonzero(needs > main.window)
        keep = max(coming_need, int(needs[needs <= main.window].max(initial=MIN_WINDOW)))
        widen = max(keep, int(needs.max(initial=0)))
        others = [(long.size, long_window)] if long is not None else []
        layouts = {"widen": [(main.size, widen)] + others}
        if outgrown.size and self.length_groups > 1:
            long_live = int(long.live.sum()) if long is not None else 0
            size = max(long.size if long is not None else 0, self._size_for(long_live + outgrown.size, MIN_SLOTS))
            if size <= self.slots:
                layouts["move"] = [(main.size, keep), (size, max(long_window, int(needs[outgrown].max())))]
        budget = self.slots * self.cache_len
        feasible = {k: v for k, v in layouts.items() if sum(s * w for s, w in v) <= budget}
        if not feasible:  # one group of every live sequence always fits: at most `slots` are live
            return self._merge(main, long, max(widen, long_window)), None
        choice = min(feasible, key=lambda k: step_cost(feasible[k], self.row_work))
        if choice == "widen":
            return self._set_window(main, widen), (self._set_window(long, long_window) if long is not None else None)
        size, window = layouts["move"][1]
        long = self._group(size, window) if long is None else self._regroup(self._set_window(long, window), size)
        self._transfer(main, long, outgrown, np.flatnonzero(~long.live)[:outgrown.size])
        return self._set_window(main, keep), long

    def _group(self, size: int, window: int) -> SlotGroup:
        self.programs.add(("empty", size, window))
        return SlotGroup(self._empty(size=size, window=window), window, np.full(size, -1, np.int64),
                         np.zeros(size, np.int64), np.zeros(size, np.int64))

    def _set_window(self, group: SlotGroup, window: int) -> SlotGroup:
        if window != group.window:
            self.programs.add(("resize", group.size, group.window, window))
            group.state, group.window = self._resize(group.state, window=window), window
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
        main = self._regroup(main, max(main.size, self._size_for(total)))
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
        dst.state, active = self._move(src.state, dst.state, jnp.asarray(src_idx), jnp.asarray(dst_idx))
        src.state = src.state.replace(active=active)
        for name in ("row", "produced", "logits_version"):
            getattr(dst, name)[dst_slots] = getattr(src, name)[src_slots]
        src.row[src_slots] = -1
        self.stats["moved_rows"] += n

    def _size_for(self, n: int, low: int = 1) -> int:
        """The smallest slot count on the ladder holding n sequences (at least `low`, at most `slots`)."""
        return self.ladder[min(bisect.bisect_left(self.ladder, max(n, low)), len(self.ladder) - 1)]

    def _compact_groups(self, main: SlotGroup, long: SlotGroup | None, pending) -> tuple:
        if long is not None and not long.live.any():
            long = None
        if long is not None and not main.live.any() and not pending:
            main, long = long, None  # only long sequences are left: their group carries on alone
        if not pending:
            main = self._shrink(main)
        return main, (self._shrink(long) if long is not None else None)

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
        state = self._compact(group.state, jnp.asarray(order), size=new_size)
        keep = order[:new_size]
        return SlotGroup(state, group.window, group.row[keep].copy(), group.produced[keep].copy(),
                         group.logits_version[keep].copy())

    def _admit_pending(self, weights, main: SlotGroup, pending, free) -> np.ndarray:
        """Prefill the next pending rows' prompts (each distinct prompt once) into the main group's free slots
        `free`; returns the slots filled."""
        take = [pending.popleft() for _ in range(len(free))]
        prompts = {r: self._requests[r].ids for r in take}
        unique: dict[tuple, int] = {}
        source = [unique.setdefault(tuple(prompts[r]), len(unique)) for r in take]
        distinct = list(unique)
        width = min(self.cache_len, pow2_at_least(max(len(p) for p in distinct), 16))
        count = pow2_at_least(len(distinct))
        tokens = np.full((count, width), self.pad_id, np.int32)
        plens = np.ones((count,), np.int32)
        for i, ids in enumerate(distinct):
            tokens[i, :len(ids)], plens[i] = ids, len(ids)
        self.programs.add(("prefill", count, width))
        prompt_cache, prompt_logits = self._prefill(weights, jnp.asarray(tokens), jnp.asarray(plens))
        self.stats["prefills"] += len(distinct)
        self.stats["prefill_rows"] += len(take)
        size = main.size
        slots = np.full((size,), size, np.int32)   # out of range: dropped
        src, lens, buds = (np.zeros((size,), np.int32) for _ in range(3))
        keys = np.zeros((size, *np.shape(self._requests[take[0]].key)), np.uint32)
        for i, (row, s) in enumerate(zip(take, free)):
            request = self._requests[row]
            slots[i], src[i], lens[i], buds[i], keys[i] = s, source[i], len(request.ids), request.budget, request.key
            main.row[s], main.produced[s] = row, 0
        self.programs.add(("admit", size, main.window, count, width))
        holds, greedy = np.zeros((size,), np.bool_), np.zeros((size,), np.bool_)
        holds[:len(take)] = [self._requests[r].hold_key is not None for r in take]
        greedy[:len(take)] = [self._requests[r].greedy for r in take]
        main.state = self._admit(main.state, prompt_cache, prompt_logits, jnp.asarray(slots), jnp.asarray(src),
                                 jnp.asarray(lens), jnp.asarray(buds), jnp.asarray(keys), jnp.asarray(holds),
                                 jnp.asarray(greedy))
        return np.asarray(free)


def build(cfg, model: PolicyModel, tokenizer, index: int = 0) -> ContinuousEngine:
    """The engine registry's entry (sampler.engine=jax)."""
    gen = cfg.generation
    return ContinuousEngine(model, tokenizer.pad_id, tokenizer.eos_ids, gen.max_prompt_tokens, gen.max_new_tokens,
                            gen.temperature, slots=gen.decode_slots, chunk_steps=gen.decode_chunk_steps,
                            length_groups=gen.decode_length_groups,
                            ragged_attention=gen.decode_attention == "auto")
