"""The JAX sampling engine (sampler.engine: jax): continuous batching over a fixed set of decode slots.

A request set (`generate`'s prompts, one row each) is served by S decode slots,
each holding one sequence's KV cache. The device runs jitted chunks of up to
`chunk_steps` decode steps over all slots (no host round trip per token); at
the chunk boundaries the host takes the new tokens, frees the slots whose
sequence ended (EOS or its token budget) and refills them from the pending
rows, while the other slots keep their caches and go on decoding. A request
set ends when its last sequence ends, never at max_new_tokens for its own sake.

- Shared prompt prefill: identical prompts among the rows being admitted (the
  G completions of a GRPO group) are prefilled once; the prompt's keys and
  values are copied into each of their slots.
- Attention follows live lengths: the slots' caches hold W positions, W the
  smallest length bucket (64, 128, 256, ... the longest sequence allowed)
  holding every live sequence to the chunk's end, so a step at live length
  100 reads 128 keys, not the whole cache. The cache is resized to a new
  bucket between chunks (rarely: buckets double), and is never sliced inside
  a chunk: a slice of the cache is a copy of it on every step.
- The slot count follows the work: S is the smallest power of two (at most
  `slots`) holding the request set, and once no row is pending and at most
  half the slots are live, the live ones are compacted into S/2 slots (down
  to 8), so a long tail does not pay for the whole batch.
- Compiled programs: one per (slots, window, greedy) for decoding, per
  (prompts, prompt-length bucket) for prefill, per (slots, window) for
  admission, compaction and resizing; `programs` lists the shapes compiled.

Layout and numerics: a slot's prompt occupies cache slots 0..P-1 with RoPE
positions 0..P-1 and its completion follows, which is what the trainer's
left-padded layout gives the same tokens (`positions_from_mask`), so
behaviour logprobs equal the trainer's recomputation to float rounding. Each
row samples with its own key, fold_in(rng, row), and its n-th token with
fold_in(that, n): results do not depend on how rows were scheduled onto slots.

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
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from grpo_stream.common.engine import decode
from grpo_stream.common.engine.base import Generation, check_request
from grpo_stream.common.model.policy import PolicyModel, policy_log_softmax

MIN_WINDOW = 64
MIN_SLOTS = 8  # compaction stops here: below it a step costs little more, and each size is another program


@struct.dataclass
class SlotState:
    cache: tuple             # per layer keys [S, KV, D, W], values [S, KV, W, D]: W the coming chunk's window
    last_logits: jax.Array   # [S, V] float32: logits for the slot's next token
    length: jax.Array        # [S] int32: tokens in the slot's cache = next write slot = next RoPE position
    produced: jax.Array      # [S] int32: completion tokens sampled so far
    budget: jax.Array        # [S] int32: completion token limit of the slot's row
    active: jax.Array        # [S] bool: the slot holds a sequence that has not ended
    keys: jax.Array          # [S, ...] uint32: the row's PRNG key data


def _pow2_at_least(n: int, low: int = 1) -> int:
    return max(low, 1 << max(0, (n - 1).bit_length()))


class ContinuousEngine:
    """Generates completions for request sets of token-id prompts with continuous batching."""

    fixed_shape = False  # any number of rows: slot counts are bucketed inside, callers need no padding rows

    def __init__(self, model: PolicyModel, pad_id: int, eos_id: int | list[int], max_prompt_tokens: int,
                 max_new_tokens: int, temperature: float, slots: int = 256, chunk_steps: int = 16):
        """`eos_id`: the stop token, or all of them; `slots`: most sequences decoded at once (KV-cache memory
        grows with it); `chunk_steps`: most decode steps between two host scheduling points."""
        if slots < 1 or chunk_steps < 1:
            raise ValueError(f"slots={slots} and chunk_steps={chunk_steps} must be >= 1")
        self.model, self.pad_id = model, pad_id
        self.eos_ids = tuple(eos_id) if isinstance(eos_id, (list, tuple)) else (eos_id,)
        self.max_prompt_tokens, self.max_new_tokens, self.temperature = max_prompt_tokens, max_new_tokens, temperature
        self.slots, self.chunk_steps = slots, chunk_steps
        decode.check_sequence_fits(model, max_prompt_tokens + max_new_tokens)
        # a completion's last token is sampled, never written: the cache needs prompt + max_new_tokens - 1 slots
        self.cache_len = -(-(max_prompt_tokens + max_new_tokens) // MIN_WINDOW) * MIN_WINDOW
        self.dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
        self.programs: set[tuple] = set()
        self.stats = collections.Counter()  # decode_steps, slot_steps, live_slot_steps, prefills, prefill_rows
        self._relayout = jax.jit(functools.partial(decode.decode_weights, model))
        self._relaid: tuple[Any, Any] = (None, None)
        self._decode = jax.jit(self._decode_chunk, static_argnames=("greedy", "window"), donate_argnums=(1,))
        self._prefill = jax.jit(self._prefill_prompts)
        self._admit = jax.jit(self._admit_rows, donate_argnums=(0,))
        self._compact = jax.jit(self._compact_slots, static_argnames=("size",))
        self._empty = jax.jit(self._empty_state, static_argnames=("size", "window"))
        self._resize = jax.jit(self._resize_window, static_argnames=("window",))

    # ---- device programs -------------------------------------------------------------------------------------

    def _empty_state(self, size: int, window: int) -> SlotState:
        arch = self.model.arch
        key_shape = jax.random.key_data(jax.random.key(0)).shape
        zeros = jnp.zeros((size,), jnp.int32)
        return SlotState(cache=decode.init_cache(self.model, size, window, self.dtype),
                         last_logits=jnp.zeros((size, arch.vocab_size), jnp.float32), length=zeros, produced=zeros,
                         budget=zeros, active=jnp.zeros((size,), jnp.bool_),
                         keys=jnp.zeros((size, *key_shape), jnp.uint32))

    def _prefill_prompts(self, weights, tokens: jax.Array, lengths: jax.Array):
        """Per layer keys [n, KV, D, P] and values [n, KV, P, D], and next-token logits [n, V], of prompts
        right-padded to P."""
        n, p = tokens.shape
        valid = jnp.arange(p)[None, :] < lengths[:, None]
        mask = jnp.tril(jnp.ones((p, p), jnp.bool_))[None] & valid[:, None, :]
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
        cache = decode.init_cache(self.model, n, p, self.dtype)
        logits, cache = decode.forward(self.model, weights, tokens, positions, cache, 0, mask)
        return cache, logits[jnp.arange(n), lengths - 1]

    def _admit_rows(self, state: SlotState, prompt_cache, prompt_logits, slots, source, lengths, budgets, keys):
        """Put prompt `source[i]`'s prefill into slot `slots[i]` (slots padded with S: ignored)."""
        p = prompt_cache[0][1].shape[2]
        cache = tuple((k.at[slots, :, :, :p].set(pk[source], mode="drop"),
                       v.at[slots, :, :p].set(pv[source], mode="drop"))
                      for (k, v), (pk, pv) in zip(state.cache, prompt_cache))
        return SlotState(cache=cache, last_logits=state.last_logits.at[slots].set(prompt_logits[source], mode="drop"),
                         length=state.length.at[slots].set(lengths, mode="drop"),
                         produced=state.produced.at[slots].set(0, mode="drop"),
                         budget=state.budget.at[slots].set(budgets, mode="drop"),
                         active=state.active.at[slots].set(True, mode="drop"),
                         keys=state.keys.at[slots].set(keys, mode="drop"))

    def _resize_window(self, state: SlotState, window: int) -> SlotState:
        """The caches cut or zero-padded to `window` positions (no live sequence is longer than the new window)."""
        def fit(x, axis):
            have = x.shape[axis]
            if have >= window:
                return jax.lax.slice_in_dim(x, 0, window, axis=axis)
            return jnp.pad(x, [(0, window - have if a == axis else 0) for a in range(x.ndim)])
        return state.replace(cache=tuple((fit(k, decode.KEY_SLOT_AXIS), fit(v, decode.VALUE_SLOT_AXIS))
                                         for k, v in state.cache))

    def _compact_slots(self, state: SlotState, order: jax.Array, size: int) -> SlotState:
        return jax.tree_util.tree_map(lambda x: x[order[:size]], state)

    def _decode_chunk(self, weights, state: SlotState, want_free: jax.Array, greedy: bool, window: int):
        """Up to chunk_steps decode steps over every slot; stops early once `want_free` slots are free (rows are
        waiting for them) or none is live. Returns the state, tokens and logprobs [S, chunk_steps] (a slot's new
        tokens are its first produced-after minus produced-before columns) and the steps taken."""
        size = state.length.shape[0]
        steps = self.chunk_steps
        eos = jnp.asarray(self.eos_ids, jnp.int32)
        columns = jnp.arange(window)
        assert state.cache[0][1].shape[2] == window, "resize the cache to the chunk's window first"

        def sample(st: SlotState):
            logp = policy_log_softmax(st.last_logits, self.temperature, self.pad_id)
            if greedy:
                tok = jnp.argmax(logp, axis=-1).astype(jnp.int32)
            else:
                u = jax.vmap(lambda kd, n: jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(kd), n)))(
                    st.keys, st.produced)
                tok = decode.inverse_cdf_index(1.0 - u, logp)
            return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]

        def body(carry):
            t, st, toks, lps = carry
            tok, tok_logp = sample(st)
            live = st.active
            toks = toks.at[:, t].set(jnp.where(live, tok, self.pad_id))
            lps = lps.at[:, t].set(jnp.where(live, tok_logp, 0.0))
            produced = st.produced + live
            ended = live & (jnp.isin(tok, eos) | (produced >= st.budget))
            # every slot runs the step; an idle or ended slot's write lands at its own length, which nothing reads
            # (a refill overwrites the prompt part and masks the rest by length)
            at = jnp.minimum(st.length, window - 1)
            key_valid = (columns[None, :] <= at[:, None])[:, None, :]
            logits, cache = decode.forward(self.model, weights, tok[:, None], at[:, None], st.cache, at, key_valid)
            st = st.replace(cache=cache, last_logits=logits[:, 0], length=st.length + live, produced=produced,
                            active=live & ~ended)
            return t + 1, st, toks, lps

        def cond(carry):
            t, st, _, _ = carry
            return (t < steps) & st.active.any() & ((size - st.active.sum()) < want_free)

        toks = jnp.full((size, steps), self.pad_id, jnp.int32)
        lps = jnp.zeros((size, steps), jnp.float32)
        t, state, toks, lps = jax.lax.while_loop(cond, body, (jnp.int32(0), state, toks, lps))
        return state, toks, lps, t

    # ---- host scheduling -------------------------------------------------------------------------------------

    def _weights(self, params: Any):
        if self._relaid[0] is not params:
            self._relaid = (None, None)  # free the previous version's copy first
            self._relaid = (params, self._relayout(params))
        return self._relaid[1]

    def generate(self, params: Any, prompts: list[list[int]], rng: jax.Array, greedy: bool = False,
                 max_new_tokens: list[int] | None = None,
                 refresh: Callable[[], tuple[Any, int] | None] | None = None, version: int = 0) -> Generation:
        """Completions of `prompts` under `params` (weight version `version`); `max_new_tokens`: a per-row token
        budget (default generation.max_new_tokens for all); `refresh`: called at chunk boundaries, returns newer
        (params, version) to continue with, or None; with it, `Generation.versions` records each token's version."""
        budgets = check_request(prompts, max_new_tokens, self.max_prompt_tokens, self.max_new_tokens)
        rows = len(prompts)
        out = Generation(tokens=np.full((rows, self.max_new_tokens), self.pad_id, np.int32),
                         logprobs=np.zeros((rows, self.max_new_tokens), np.float32),
                         lengths=np.zeros((rows,), np.int32), finished=np.zeros((rows,), np.bool_),
                         versions=np.full((rows, self.max_new_tokens), -1, np.int32) if refresh else None)
        if not rows:
            return out
        weights = self._weights(params)
        row_keys = np.asarray(jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(rows))))
        size = min(self.slots, _pow2_at_least(rows))
        window = MIN_WINDOW
        state = self._empty(size=size, window=window)
        self.programs.add(("empty", size, window))
        pending = collections.deque(range(rows))
        slot_row = np.full(size, -1, np.int64)       # row each slot serves, -1: free
        produced = np.zeros(size, np.int64)            # tokens already copied out, per slot
        prompt_lens = np.array([len(p) for p in prompts])
        # version of the weights that computed each slot's next-token logits: the first token of a chunk after an
        # update was drawn from logits the previous weights computed, so it records their version
        logits_version = np.zeros(size, np.int64)
        while True:
            if refresh is not None:
                update = refresh()
                if update is not None:
                    params, version = update
                    weights = self._weights(params)
            free = np.flatnonzero(slot_row < 0)
            coming = [pending[i] for i in range(min(len(free), len(pending)))]  # rows admitted before this chunk
            live = slot_row >= 0
            if not live.any() and not coming:
                return out
            # tokens in the fullest cache this chunk starts with
            longest = max(([int((prompt_lens[slot_row[live]] + produced[live]).max())] if live.any() else [])
                          + [int(prompt_lens[r]) for r in coming])
            fits = min(self.cache_len, _pow2_at_least(longest + self.chunk_steps, MIN_WINDOW))
            if fits != window:
                self.programs.add(("resize", size, window, fits))
                state, window = self._resize(state, window=fits), fits
            if coming:
                state, admitted = self._admit_pending(weights, state, pending, free, prompts, budgets, row_keys,
                                                      slot_row, produced)
                logits_version[admitted] = version
            live = slot_row >= 0
            want_free = min(len(pending), max(1, size // 8)) if pending else size + 1
            self.programs.add(("decode", size, window, greedy))
            state, toks, lps, steps = self._decode(weights, state, jnp.int32(want_free), greedy=greedy, window=window)
            toks, lps, now_produced, active, steps = jax.device_get((toks, lps, state.produced, state.active, steps))
            self.stats["decode_steps"] += int(steps)
            self.stats["slot_steps"] += int(steps) * size
            self.stats["live_slot_steps"] += int(now_produced[live].sum() - produced[live].sum())
            for s in np.flatnonzero(live):
                row, start, end = slot_row[s], produced[s], now_produced[s]
                out.tokens[row, start:end] = toks[s, :end - start]
                out.logprobs[row, start:end] = lps[s, :end - start]
                if end > start and out.versions is not None:
                    out.versions[row, start] = logits_version[s]
                    out.versions[row, start + 1:end] = version
                    logits_version[s] = version
                produced[s] = end
                if not active[s]:
                    out.lengths[row] = end
                    out.finished[row] = end > 0 and int(out.tokens[row, end - 1]) in self.eos_ids
                    slot_row[s] = -1
            if not pending and size > MIN_SLOTS and (slot_row >= 0).sum() <= size // 2:
                state, slot_row, produced, logits_version = self._shrink(state, slot_row, produced, logits_version)
                size = len(slot_row)

    def _admit_pending(self, weights, state, pending, free, prompts, budgets, row_keys, slot_row, produced):
        """Prefill the next pending rows' prompts (each distinct prompt once) into the free slots; returns the new
        state and the slots filled."""
        size = len(slot_row)
        take = [pending.popleft() for _ in range(min(len(free), len(pending)))]
        unique: dict[tuple, int] = {}
        source = [unique.setdefault(tuple(prompts[r]), len(unique)) for r in take]
        distinct = list(unique)
        width = min(self.cache_len, _pow2_at_least(max(len(p) for p in distinct), 16))
        count = _pow2_at_least(len(distinct))
        tokens = np.full((count, width), self.pad_id, np.int32)
        plens = np.ones((count,), np.int32)
        for i, ids in enumerate(distinct):
            tokens[i, :len(ids)], plens[i] = ids, len(ids)
        self.programs.add(("prefill", count, width))
        prompt_cache, prompt_logits = self._prefill(weights, jnp.asarray(tokens), jnp.asarray(plens))
        self.stats["prefills"] += len(distinct)
        self.stats["prefill_rows"] += len(take)
        slots = np.full((size,), size, np.int32)   # out of range: dropped
        src = np.zeros((size,), np.int32)
        lens = np.zeros((size,), np.int32)
        buds = np.zeros((size,), np.int32)
        keys = np.zeros((size, *row_keys.shape[1:]), np.uint32)
        for i, (row, s) in enumerate(zip(take, free)):
            slots[i], src[i], lens[i], buds[i], keys[i] = s, source[i], len(prompts[row]), budgets[row], row_keys[row]
            slot_row[s], produced[s] = row, 0
        self.programs.add(("admit", size, state.cache[0][1].shape[2], count, width))
        state = self._admit(state, prompt_cache, prompt_logits, jnp.asarray(slots), jnp.asarray(src),
                            jnp.asarray(lens), jnp.asarray(buds), jnp.asarray(keys))
        return state, free[:len(take)]

    def _shrink(self, state, slot_row, *per_slot):
        """Move the live slots (at most half) into half as many slots. Halving, not jumping to the smallest size
        that fits, keeps the compiled shapes to one chain (S, S/2, ..., MIN_SLOTS)."""
        size = len(slot_row)
        live = np.flatnonzero(slot_row >= 0)
        new_size = size // 2
        order = np.concatenate([live, np.flatnonzero(slot_row < 0)]).astype(np.int32)
        self.programs.add(("compact", size, state.cache[0][1].shape[2], new_size))
        state = self._compact(state, jnp.asarray(order), size=new_size)
        keep = order[:new_size]
        return (state, slot_row[keep].copy(), *(x[keep].copy() for x in per_slot))


def build(cfg, model: PolicyModel, tokenizer, index: int = 0) -> ContinuousEngine:
    """The engine registry's entry (sampler.engine=jax)."""
    gen = cfg.generation
    return ContinuousEngine(model, tokenizer.pad_id, tokenizer.eos_ids, gen.max_prompt_tokens, gen.max_new_tokens,
                            gen.temperature, slots=gen.decode_slots, chunk_steps=gen.decode_chunk_steps)
