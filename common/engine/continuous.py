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

The engine is composed of objects that each own their state: the jitted device programs (slot_programs.py), the
slot table of one or two groups and their windows (slot_table.py), the rows of the requests taken with their
outputs (request_rows.py), the held slots of multi-turn episodes (held_turns.py), and the endpoint's queue whose
requests join a serve (side_requests.py). `ContinuousEngine` holds them and runs the scheduling loop over them.

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

import collections
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.config.serving import engine_context
from grpo_stream.common.engine import cpu_attention, decode
from grpo_stream.common.engine.base import Generation, RequestSource, generate_by_serving, take_weights
from grpo_stream.common.engine.held_turns import HeldTurns
from grpo_stream.common.engine.request_rows import RequestRows
from grpo_stream.common.engine.side_requests import SideQueue, serve_sharing
from grpo_stream.common.engine.slot_programs import MIN_WINDOW, SlotPrograms, pow2_at_least
from grpo_stream.common.engine.slot_table import SlotGroup, SlotTable
from grpo_stream.common.model.policy import PolicyModel


class ContinuousEngine:
    """Generates completions for request sets of token-id prompts with continuous batching. `stats` counts its work
    (decode_steps, slot_steps, live_slot_steps, prefills, prefill_rows, ...) and `programs` lists the shapes it
    compiled; `side`: an endpoint's queue whose requests join every serve (side_requests.py), or None."""

    def __init__(self, model: PolicyModel, pad_id: int, eos_id: int | list[int], max_prompt_tokens: int,
                 max_new_tokens: int, temperature: float, slots: int = 256, chunk_steps: int = 16,
                 length_groups: int = 1, ragged_attention: bool = True, context_tokens: int | None = None,
                 context_field: str = "generation.max_prompt_tokens + generation.max_new_tokens"):
        """`eos_id`: the stop token, or all of them; `slots`: most sequences decoded at once (KV-cache memory
        grows with it); `chunk_steps`: most decode steps between two host scheduling points; `length_groups`: 1
        (every slot attends over the longest live sequence's window) or 2 (long sequences may move to their own
        group); `ragged_attention`: on one CPU device in float32, attention reads each slot's own positions through
        the CPU kernel (cpu_attention.py) where it builds; `context_tokens`: KV positions per sequence when more than
        max_prompt_tokens + max_new_tokens (the OpenAI endpoint's longer context), asked for by `context_field`."""
        if slots < 1 or chunk_steps < 1 or length_groups not in (1, 2):
            raise ValueError(f"slots={slots} and chunk_steps={chunk_steps} must be >= 1, length_groups="
                             f"{length_groups} 1 or 2")
        eos_ids = tuple(eos_id) if isinstance(eos_id, (list, tuple)) else (eos_id,)
        self.model, self.pad_id = model, pad_id
        self.max_prompt_tokens, self.max_new_tokens = max_prompt_tokens, max_new_tokens
        self.slots, self.ragged_attention = slots, ragged_attention
        context = max(max_prompt_tokens + max_new_tokens, context_tokens or 0)
        decode.check_sequence_fits(model, context, context_field)
        # every sampled token is written back, the last one too (a held turn resumes after it): prompt +
        # max_new_tokens positions, rounded up to whole windows
        self.cache_len = -(-context // MIN_WINDOW) * MIN_WINDOW
        self.context_capacity = self.cache_len  # the longest prompt + completion a sequence may have
        arch = model.arch
        # a row's work outside attention in cache positions: the parameters over one position's keys and values
        # (2 x KV x D x layers numbers) is the ratio of their memory traffic; measured on CPU (bench sampler's
        # model: 1.0 ms per row and 1.1 us per position at 256 slots) the matmul side is 16x cheaper than that
        row_work = model.num_params() / (2 * arch.num_kv_heads * arch.head_dim * arch.num_layers) / 16
        self.programs: set[tuple] = set()
        self.stats = collections.Counter()
        self.side: SideQueue | None = None
        self.device = SlotPrograms(model, pad_id, eos_ids, temperature, chunk_steps, max_forced=max_new_tokens)
        self.table = SlotTable(self.device, slots, length_groups, self.cache_len, row_work, self.programs, self.stats)
        self.rows = RequestRows(pad_id, eos_ids, self.cache_len, max_new_tokens, arch.vocab_size, self.stats,
                                context_field)
        self.held = HeldTurns(self.table, self.rows, self.device, self.programs, self.stats)
        self._relaid: tuple[Any, Any, bool] = (None, None, False)  # params, their decode layout, ragged

    def request_keys(self, rng: jax.Array, rows: int) -> list:
        """The key of each row of a batch generated with `rng`: row i samples with fold_in(rng, i)."""
        return self.device.request_keys(rng, rows)

    def _weights(self, params: Any):
        """`params` laid out for decoding, made once per weight version, and whether its decode attention reads each
        slot's own positions (cpu_attention.py): float32 weights on one CPU device (a mesh of several would need the
        kernel partitioned) and the kernel built."""
        if self._relaid[0] is not params:
            self._relaid = (None, None, False)  # free the previous version's copy first
            weights = self.device.relayout(params)
            self.device.use_mesh(weights)  # the slot state it decodes with lies on the same mesh (slot_programs.py)
            leaf = jax.tree_util.tree_leaves(weights)[0]
            devices = leaf.sharding.device_set
            ragged = (self.ragged_attention and leaf.dtype == jnp.float32 and len(devices) == 1
                      and next(iter(devices)).platform == "cpu" and cpu_attention.available())
            self._relaid = (params, weights, ragged)
        return self._relaid[1]

    def release(self) -> None:
        """Drop what the last serve kept on the devices: the weights it was given and their decode layout, its slots'
        caches, its rows. A sampler keeps them (the next serve reuses the layout); a one-shot user (the trainer's
        evaluations) calls this, or they would stay beside training until its next call."""
        self._relaid = (None, None, False)
        self.table.clear()
        self.rows.reset(None)
        self.held.clear()

    def generate(self, params: Any, prompts: list[list[int]], rng: jax.Array, greedy: bool = False,
                 max_new_tokens: list[int] | None = None,
                 refresh: Callable[[], tuple[Any, int] | None] | None = None, version: int = 0) -> Generation:
        """Completions of `prompts` under `params` (weight version `version`); `max_new_tokens`: a per-row token
        budget (default generation.max_new_tokens for all); `refresh`: called at chunk boundaries, returns newer
        (params, version) to continue with, or None; with it, `Generation.versions` records each token's version."""
        return generate_by_serving(self, params, prompts, rng, greedy, max_new_tokens, refresh, version)

    def serve(self, params: Any, source: RequestSource, refresh: Callable | None = None, version: int = 0) -> None:
        """Decode what `source` hands out (base.RequestSource) and the endpoint's queued requests (`side`), under its
        lock; `refresh`: called at scheduling points, returns newer (params, version) for every live sequence."""
        serve_sharing(self.side, self.serve_alone, params, source, refresh, version)

    def serve_alone(self, params: Any, source: RequestSource,
                    refresh: Callable[[], tuple[Any, int] | None] | None = None, version: int = 0) -> None:
        """Decode the requests `source` hands out until it has none left and none will come (or it is cancelled):
        each chunk boundary takes the requests ready then (a multi-turn episode's next turn enters when its
        environment has answered, a sampler's next group when one ended, while the other slots keep decoding) and
        hands every ended sequence back through `source.finish`. A serve may last a sampler's life: rows are
        recycled once their sequence is handed back."""
        params = take_weights(params)  # a sampler's FirstWeights: held here alone, replaced by the next version
        weights = self._weights(params)
        table, rows, held = self.table, self.rows, self.held
        table.clear()
        rows.reset(source)
        held.clear()
        pending: collections.deque = collections.deque()
        while not source.cancelled():
            if refresh is not None:
                update = refresh()
                if update is not None:
                    params, version = update
                    weights = None  # the previous version's layout freed before the new one is made: one at a time
                    weights = self._weights(params)
            held.release(source.released())
            taken = held.resume(source.take(), refresh is not None)
            pending.extend(rows.register(r, refresh is not None) for r in taken)
            self._stop_withdrawn(source, pending)
            running = rows.decoding(table.main) + rows.decoding(table.long)
            if pending:  # the main group grows to hold what waits (a fixed request set: sized once, at the start)
                held.evict(len(pending))
                table.grow(len(pending))
            if not running and not pending:
                if not source.open():
                    held.clear()
                    return
                source.wait(0.5)
                continue
            free = int((~table.main.live).sum())
            coming = [pending[i] for i in range(min(free, len(pending), self.slots - table.live_count()))]
            table.fit_windows(rows.prompt_lens, coming)
            free = np.flatnonzero(~table.main.live)  # after fitting: a merge or regroup moves live sequences into slots
            coming = coming[:len(free)]
            if coming:
                admitted = self._admit_pending(weights, table.main, pending, free[:len(coming)])
                table.main.logits_version[admitted] = version
            if running or coming:
                self._decode_and_collect(weights, len(pending), version)
            table.shrink(bool(pending))

    def _stop_withdrawn(self, source, pending: collections.deque) -> None:
        """Endpoint sequences whose caller went away (side_requests.MergedSource.withdrawn; other sources have none)
        leave the pending rows, and their slots are freed, here rather than decoding to their budget for nobody."""
        withdrawn = getattr(source, "withdrawn", None)
        gone = withdrawn() if withdrawn is not None else None
        if not gone:
            return
        requests, gone_ids = self.rows.requests, {id(r) for r in gone}  # by identity: other rows' tags may not hash

        def left(row) -> bool:
            return requests[row] is not None and id(requests[row].tag) in gone_ids

        kept = [row for row in pending if not left(row)]
        for row in pending:
            if left(row):
                self.rows.free(row)
        pending.clear()
        pending.extend(kept)
        for group in self.table.groups:
            slots = [] if group is None else [s for s in np.flatnonzero(group.live) if left(group.row[s])]
            if slots:
                for s in slots:
                    self.rows.free(int(group.row[s]))
                    group.row[s] = -1
                group.state = group.state.replace(active=group.state.active.at[np.asarray(slots)].set(False))
        self.stats["withdrawn_rows"] += len(gone)

    def _decode_and_collect(self, weights, waiting: int, version: int) -> None:
        """One decode chunk over the live groups, its tokens copied out."""
        main, long = self.table.groups
        held = main.size * main.window + (long.size * long.window if long is not None else 0)
        self.stats["peak_cache_positions"] = max(self.stats["peak_cache_positions"], held)
        groups = [g for g in (main, long) if g is not None and g.live.any()]
        if groups[0] is main and waiting:  # stop early once enough slots are free for waiting rows
            want_free = int((~main.live).sum()) + min(waiting, max(1, main.size // 8))
        else:
            want_free = groups[0].size + 1
        windows, ragged = tuple(g.window for g in groups), self._relaid[2]
        self.programs.add(("decode", tuple((g.size, g.window) for g in groups), ragged))
        states, toks, lps, steps = self.device.decode(weights, tuple(g.state for g in groups), jnp.int32(want_free),
                                                      windows=windows, ragged=ragged)
        fetched = jax.device_get((toks, lps, tuple((s.produced, s.active) for s in states), steps))
        for i, group in enumerate(groups):
            group.state = states[i]
            self.rows.collect(group, fetched[0][i], fetched[1][i], *fetched[2][i], fetched[3], version, ragged,
                              self.held)
        self.stats["decode_steps"] += int(fetched[3])

    def _admit_pending(self, weights, main: SlotGroup, pending, free) -> np.ndarray:
        """Prefill the next pending rows' prompts (each distinct prompt once) into the main group's free slots
        `free`; returns the slots filled."""
        requests = self.rows.requests
        take = [pending.popleft() for _ in range(len(free))]
        prompts = {r: requests[r].ids for r in take}
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
        prompt_cache, prompt_logits = self.device.prefill(weights, jnp.asarray(tokens), jnp.asarray(plens))
        self.stats["prefills"] += len(distinct)
        self.stats["prefill_rows"] += len(take)
        size = main.size
        slots = np.full((size,), size, np.int32)   # out of range: dropped
        src, lens, buds = (np.zeros((size,), np.int32) for _ in range(3))
        keys = np.zeros((size, *np.shape(requests[take[0]].key)), np.uint32)
        for i, (row, s) in enumerate(zip(take, free)):
            request = requests[row]
            slots[i], src[i], lens[i], buds[i], keys[i] = s, source[i], len(request.ids), request.budget, request.key
            main.row[s], main.produced[s] = row, 0
        self.programs.add(("admit", size, main.window, count, width))
        holds, greedy = np.zeros((size,), np.bool_), np.zeros((size,), np.bool_)
        holds[:len(take)] = [requests[r].hold_key is not None for r in take]
        greedy[:len(take)] = [requests[r].greedy for r in take]
        main.state = self.device.admit(main.state, prompt_cache, prompt_logits, jnp.asarray(slots),
                                       jnp.asarray(src), jnp.asarray(lens), jnp.asarray(buds), jnp.asarray(keys),
                                       jnp.asarray(holds), jnp.asarray(greedy))
        return np.asarray(free)


def engine_settings(cfg) -> dict:
    """The ContinuousEngine arguments a run's config sets beyond the model and tokenizer: what a sampler builds and
    what `plan` compiles (the same slots, chunks, length groups and cache, the endpoint's context included)."""
    gen = cfg.generation
    context, field = engine_context(cfg)
    return dict(max_prompt_tokens=gen.max_prompt_tokens, max_new_tokens=gen.max_new_tokens,
                temperature=gen.temperature, slots=gen.decode_slots, chunk_steps=gen.decode_chunk_steps,
                length_groups=gen.decode_length_groups, ragged_attention=gen.decode_attention == "auto",
                context_tokens=context, context_field=field)


def build(cfg, model: PolicyModel, tokenizer, index: int = 0) -> ContinuousEngine:
    """The engine registry's entry (sampler.engine=jax)."""
    return ContinuousEngine(model, tokenizer.pad_id, tokenizer.eos_ids, **engine_settings(cfg))
