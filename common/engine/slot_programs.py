"""The continuous engine's device programs: decode slots and what can be done to them.

A slot group (`SlotState`) is S decode slots whose caches share one window W:
per layer keys [S, KV, D, W] and values [S, KV, W, D]. `SlotPrograms` holds the jitted programs of one model, each
compiled once per shape; the host objects that drive them (slot_table.py, request_rows.py, held_turns.py,
continuous.py) record each shape they run in the engine's `programs`:

- `prefill`: a batch of distinct prompts' keys, values and next-token logits;
- `admit`: put prefilled prompts into free slots of a group;
- `decode`: a chunk of up to `chunk_steps` decode steps over one or more groups, one weight pass per step
  for all of them (the matmuls see every row, attention runs per group over its own window);
- `resize`: change a group's window (between chunks: a slice inside a chunk is a copy per step);
- `compact`: gather a group's live slots into fewer slots;
- `move`: copy slots of one group into free slots of another (a longer sequence joining the long-window
  group, or two groups merging), clearing them in the source;
- `resume`: wake held slots (a multi-turn episode whose turn ended and whose cache was kept) with forced tokens
  (the environment's observation), which decoding feeds in one per step before it samples again;
- `relayout`: the params laid out for decoding; `empty`: a group of free slots.

On a device mesh (sampler.mesh.tp > 1) the programs are traced with the layout of the slot state they make
(`use_mesh`): the caches' KV heads split over `tp` where it divides them, and the rest of the state whole on every
device (decode.py lays out the attention's heads to match). Left to XLA's propagation, a new group was made whole
on one device (its caches too), and with KV heads that `tp` does not divide the caches were all-reduced whole over
the mesh after every chunk. There the caches are whole on every device (each device's query heads read their KV
heads from its copy): tp x the cache memory of a split.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from grpo_stream.common.engine import decode
from grpo_stream.common.model.activation_sharding import activation_sharding, constrain
from grpo_stream.common.model.policy import PolicyModel, policy_log_softmax

log = logging.getLogger(__name__)
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
    forced: jax.Array        # [S, F] int32: tokens the slot is fed instead of sampling (an observation appended to
    #                          a held episode's cache), from forced_at on, forced_left of them
    forced_at: jax.Array     # [S] int32
    forced_left: jax.Array   # [S] int32
    hold: jax.Array          # [S] bool: keep the cache when the sequence ends (an episode's next turn may resume it)
    key_base: jax.Array      # [S] int32: token n of the slot samples with fold_in(key, n - key_base) (a resumed turn
    #                          starts its own key's stream where its forced tokens end, as if it had been prefilled)
    greedy: jax.Array        # [S] bool: the slot's row takes the most likely token (else samples at the temperature)


def pow2_at_least(n: int, low: int = 1) -> int:
    return max(low, 1 << max(0, (n - 1).bit_length()))


def slot_ladder(most: int) -> list[int]:
    """The slot counts a group may have, up to `most`: powers of two, and from 8 on also 1.5x them (8, 12, 16, 24,
    32, 48, ...). Steps of 1.5x / 1.33x instead of 2x keep more of a shrinking tail's slots live, at the price of
    one more compiled shape per octave."""
    sizes, p = set(), 1
    while p < 2 * most:
        sizes.update((p, p + p // 2) if p >= MIN_SLOTS else (p,))
        p *= 2
    return sorted({min(s, most) for s in sizes})


def window_of(state: SlotState) -> int:
    return state.cache[0][1].shape[decode.VALUE_SLOT_AXIS]


def mesh_of(weights) -> Mesh | None:
    """The mesh of several devices `weights` (relayout's output) lie on, or None."""
    mesh = getattr(jax.tree_util.tree_leaves(weights)[0].sharding, "mesh", None)
    return mesh if mesh is not None and mesh.size > 1 else None


class SlotPrograms:
    """The jitted programs over slot groups of one model (see the module docstring). Holds no host state: what runs
    on which slots is the caller's."""

    def __init__(self, model: PolicyModel, pad_id: int, eos_ids: tuple[int, ...], temperature: float,
                 chunk_steps: int, max_forced: int = 1):
        self.model, self.pad_id, self.eos_ids = model, pad_id, eos_ids
        self.temperature, self.chunk_steps, self.max_forced = temperature, chunk_steps, max_forced
        self.dtype = jax.tree_util.tree_leaves(model.params)[0].dtype
        self.mesh: Mesh | None = None  # use_mesh's
        self.relayout = jax.jit(functools.partial(decode.decode_weights, model))
        self._jit_programs()

    def use_mesh(self, weights) -> None:
        """Lay the slot state every program makes out on the mesh `weights` (relayout's output) lie on; the programs
        are traced again when that changes (a mesh is not an argument of theirs). The engine calls it with each
        version's weights, before a serve makes its groups."""
        mesh = mesh_of(weights)
        if mesh != self.mesh:
            self.mesh = mesh
            self._jit_programs()
            tp, kv = dict(mesh.shape).get("tp", 1) if mesh is not None else 1, self.model.arch.num_kv_heads
            if kv % tp:
                log.warning("sampler.mesh.tp=%d does not divide the model's %d KV heads: every device keeps the whole "
                            "KV cache (all %d heads); choose a tp dividing %d to split it", tp, kv, kv, kv)

    def _on_mesh(self, program):
        """`program` traced with the cache and activation layouts on `mesh` (decode.CACHE_SPEC, HEADS_SPEC)."""
        @functools.wraps(program)
        def traced(*args, **kwargs):
            with activation_sharding(self.mesh):
                return program(*args, **kwargs)
        return traced

    def _pin(self, state: SlotState) -> SlotState:
        """`state` with its caches on decode.CACHE_SPEC and the rest whole on every device (as it is off a mesh)."""
        rest = jax.tree_util.tree_map(lambda x: constrain(x, ()), state.replace(cache=()))
        return rest.replace(cache=decode.pin_cache(state.cache))

    def _jit_programs(self) -> None:
        on = self._on_mesh
        self.decode = jax.jit(on(self._decode_chunk), static_argnames=("windows", "ragged"), donate_argnums=(1,))
        self.prefill = jax.jit(on(self._prefill_prompts))
        self.admit = jax.jit(on(self._admit_rows), donate_argnums=(0,))
        self.compact = jax.jit(on(self._compact_slots), static_argnames=("size",))
        self.empty = jax.jit(on(self._empty_state), static_argnames=("size", "window"))
        self.resize = jax.jit(on(self._resize_window), static_argnames=("window",))
        self.move = jax.jit(on(self._move_slots), donate_argnums=(1,))
        self.resume = jax.jit(on(self._resume_slots), donate_argnums=(0,))

    def request_keys(self, rng: jax.Array, rows: int) -> list:
        """The key of each row of a batch generated with `rng`: row i samples with fold_in(rng, i)."""
        return list(np.asarray(jax.random.key_data(jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(rows)))))

    def _empty_state(self, size: int, window: int) -> SlotState:
        arch = self.model.arch
        key_shape = jax.random.key_data(jax.random.key(0)).shape
        zeros = jnp.zeros((size,), jnp.int32)
        return self._pin(SlotState(cache=decode.init_cache(self.model, size, window, self.dtype),
                         last_logits=jnp.zeros((size, arch.vocab_size), jnp.float32), length=zeros, produced=zeros,
                         budget=zeros, active=jnp.zeros((size,), jnp.bool_),
                         keys=jnp.zeros((size, *key_shape), jnp.uint32),
                         forced=jnp.zeros((size, self.max_forced), jnp.int32), forced_at=zeros, forced_left=zeros,
                         hold=jnp.zeros((size,), jnp.bool_), key_base=zeros,
                         greedy=jnp.zeros((size,), jnp.bool_)))

    def _prefill_prompts(self, weights, tokens: jax.Array, lengths: jax.Array):
        """Per layer keys [n, KV, D, P] and values [n, KV, P, D], and next-token logits [n, V], of prompts
        right-padded to P."""
        n, p = tokens.shape
        valid = jnp.arange(p)[None, :] < lengths[:, None]
        mask = jnp.tril(jnp.ones((p, p), jnp.bool_))[None] & valid[:, None, :]
        positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (n, p))
        cache = decode.init_cache(self.model, n, p, self.dtype)
        logits, cache = decode.forward(self.model, weights, tokens, positions, cache, 0, mask, last=lengths - 1)
        return decode.pin_cache(cache), logits

    def _admit_rows(self, state: SlotState, prompt_cache, prompt_logits, slots, source, lengths, budgets, keys, holds,
                    greedy):
        """Put prompt `source[i]`'s prefill into slot `slots[i]` (slots padded with S: ignored)."""
        p = prompt_cache[0][1].shape[2]
        cache = tuple((k.at[slots, :, :, :p].set(pk[source], mode="drop"),
                       v.at[slots, :, :p].set(pv[source], mode="drop"))
                      for (k, v), (pk, pv) in zip(state.cache, prompt_cache))
        return self._pin(SlotState(
            cache=cache, last_logits=state.last_logits.at[slots].set(prompt_logits[source], mode="drop"),
            length=state.length.at[slots].set(lengths, mode="drop"),
            produced=state.produced.at[slots].set(0, mode="drop"),
            budget=state.budget.at[slots].set(budgets, mode="drop"),
            active=state.active.at[slots].set(True, mode="drop"),
            keys=state.keys.at[slots].set(keys, mode="drop"), forced=state.forced,
            forced_at=state.forced_at, forced_left=state.forced_left.at[slots].set(0, mode="drop"),
            hold=state.hold.at[slots].set(holds, mode="drop"),
            key_base=state.key_base.at[slots].set(0, mode="drop"),
            greedy=state.greedy.at[slots].set(greedy, mode="drop")))

    def _resume_slots(self, state: SlotState, slots, forced, counts, budgets, keys, greedy) -> SlotState:
        """Wake held slots `slots[i]` (padded with S: ignored): feed them forced[i, :counts[i]] before sampling again,
        and let them produce until `budgets[i]` tokens in all (the forced ones count)."""
        return self._pin(state.replace(forced=state.forced.at[slots].set(forced, mode="drop"),
                             forced_at=state.forced_at.at[slots].set(0, mode="drop"),
                             forced_left=state.forced_left.at[slots].set(counts, mode="drop"),
                             budget=state.budget.at[slots].set(budgets, mode="drop"),
                             active=state.active.at[slots].set(True, mode="drop"),
                             keys=state.keys.at[slots].set(keys, mode="drop"),
                             greedy=state.greedy.at[slots].set(greedy, mode="drop"),
                             key_base=state.key_base.at[slots].set(
                                 state.produced[jnp.minimum(slots, state.produced.shape[0] - 1)] + counts, mode="drop")))

    def _resize_window(self, state: SlotState, window: int) -> SlotState:
        """The caches cut or zero-padded to `window` positions (no live sequence is longer than the new window)."""
        def fit(x, axis):
            have = x.shape[axis]
            if have >= window:
                return jax.lax.slice_in_dim(x, 0, window, axis=axis)
            return jnp.pad(x, [(0, window - have if a == axis else 0) for a in range(x.ndim)])
        return self._pin(state.replace(cache=tuple((fit(k, decode.KEY_SLOT_AXIS), fit(v, decode.VALUE_SLOT_AXIS))
                                                   for k, v in state.cache)))

    def _compact_slots(self, state: SlotState, order: jax.Array, size: int) -> SlotState:
        return self._pin(jax.tree_util.tree_map(lambda x: x[order[:size]], state))

    def _move_slots(self, src: SlotState, dst: SlotState, src_slots: jax.Array, dst_slots: jax.Array):
        """Copy slot src_slots[i] of `src` into slot dst_slots[i] of `dst` (index vectors padded with each group's
        size: ignored). Copies the first min(W_src, W_dst) cache positions, which hold every moved sequence (the
        caller makes sure). Returns the new `dst` and src's `active` with the moved slots cleared; src's caches
        are left as they are (returning them would copy them)."""
        n_src = src.length.shape[0]
        take = jnp.minimum(src_slots, n_src - 1)  # padding gathers a real slot; its write is dropped
        m = min(window_of(src), window_of(dst))
        cache = tuple((dk.at[dst_slots, :, :, :m].set(sk[take][..., :m], mode="drop"),
                       dv.at[dst_slots, :, :m].set(sv[take][:, :, :m], mode="drop"))
                      for (dk, dv), (sk, sv) in zip(dst.cache, src.cache))
        moved = {name: getattr(dst, name).at[dst_slots].set(getattr(src, name)[take], mode="drop")
                 for name in ("last_logits", "length", "produced", "budget", "active", "keys", "forced", "forced_at",
                              "forced_left", "hold", "key_base", "greedy")}
        return self._pin(dst.replace(cache=cache, **moved)), src.active.at[src_slots].set(False, mode="drop")

    def _decode_chunk(self, weights, groups: tuple, want_free: jax.Array, windows: tuple, ragged: bool = False):
        """Up to chunk_steps decode steps over every slot of the slot groups `groups` (SlotStates with the windows
        `windows`), one weight pass per step for all of them; stops early once `want_free` slots of the first group
        are free (rows are waiting for them) or none is live. Returns the groups, and per group the tokens and
        logprobs [S, chunk_steps] (a slot's new tokens are its first produced-after minus produced-before
        columns); and the steps taken. `ragged`: attention reads each slot's own positions (the CPU kernel)."""
        steps = self.chunk_steps
        eos = jnp.asarray(self.eos_ids, jnp.int32)
        assert tuple(window_of(g) for g in groups) == windows, "resize the caches to the chunk's windows first"

        def sample(st: SlotState):
            # each slot samples its own row's way: greedy rows (evaluation probes, greedy endpoint requests) beside
            # sampled ones in one program, so no row waits for a serve of its kind
            logp = policy_log_softmax(st.last_logits, self.temperature, self.pad_id)
            u = jax.vmap(lambda kd, n: jax.random.uniform(jax.random.fold_in(jax.random.wrap_key_data(kd), n)))(
                st.keys, st.produced - st.key_base)
            tok = jnp.where(st.greedy, jnp.argmax(logp, axis=-1).astype(jnp.int32),
                            decode.inverse_cdf_index(1.0 - u, logp))
            return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]

        def body(carry):
            t, sts, toks, lps = carry
            drawn, ats, valids, toks_out, lps_out = [], [], [], [], []
            for st, window, tk, lp in zip(sts, windows, toks, lps):
                tok, tok_logp = sample(st)
                # a held slot first takes its forced tokens (an observation): fed, not sampled, with no logprob
                forcing = st.forced_left > 0
                fed = jnp.take_along_axis(st.forced, jnp.minimum(st.forced_at, self.max_forced - 1)[:, None], 1)[:, 0]
                tok, tok_logp = jnp.where(forcing, fed, tok), jnp.where(forcing, 0.0, tok_logp)
                toks_out.append(tk.at[:, t].set(jnp.where(st.active, tok, self.pad_id)))
                lps_out.append(lp.at[:, t].set(jnp.where(st.active, tok_logp, 0.0)))
                # every slot runs the step; an idle or ended slot writes at position 0 and attends over it alone
                # (ragged attention then reads nothing else of it); nothing reads an idle slot's cache, and a refill
                # overwrites the prompt part and masks the rest by length. A held slot's cache is kept: it writes at
                # its next position, which its first forced token overwrites
                at = jnp.where(st.active | st.hold, jnp.minimum(st.length, window - 1), 0)
                drawn.append(tok)
                ats.append(at)
                valids.append((jnp.arange(window)[None, :] <= at[:, None])[:, None, :])
            tok_all, at_all = jnp.concatenate(drawn), jnp.concatenate(ats)
            logits, caches = decode.forward_groups(self.model, weights, tok_all[:, None], at_all[:, None],
                                                   tuple(st.cache for st in sts), tuple(ats), tuple(valids), ragged)
            new, start = [], 0
            for st, tok, cache in zip(sts, drawn, caches):
                n = st.length.shape[0]
                live = st.active
                forcing = live & (st.forced_left > 0)
                produced = st.produced + live
                ended = live & ~forcing & (jnp.isin(tok, eos) | (produced >= st.budget))
                # pinned in the loop too: a carry XLA lays out its own way is gathered back after the chunk
                new.append(self._pin(st.replace(
                    cache=cache, last_logits=logits[start:start + n, 0], length=st.length + live, produced=produced,
                    active=live & ~ended, forced_at=st.forced_at + forcing, forced_left=st.forced_left - forcing)))
                start += n
            return t + 1, tuple(new), tuple(toks_out), tuple(lps_out)

        def cond(carry):
            t, sts, _, _ = carry
            first = sts[0].active
            live = jnp.any(jnp.stack([st.active.any() for st in sts]))
            return (t < steps) & live & ((first.shape[0] - first.sum()) < want_free)

        toks = tuple(jnp.full((g.length.shape[0], steps), self.pad_id, jnp.int32) for g in groups)
        lps = tuple(jnp.zeros((g.length.shape[0], steps), jnp.float32) for g in groups)
        t, groups, toks, lps = jax.lax.while_loop(cond, body, (jnp.int32(0), tuple(self._pin(g) for g in groups),
                                                               toks, lps))
        return tuple(self._pin(g) for g in groups), toks, lps, t
