"""The continuous engine's device programs on slot groups: the slot ladder and moving sequences between groups."""

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.engine.slot_programs import SlotPrograms, slot_ladder, window_of


def test_the_slot_ladder_steps_by_a_half_or_a_third_and_stops_at_the_most():
    assert slot_ladder(256) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert slot_ladder(100) == [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 100]
    assert slot_ladder(1) == [1]


def test_moving_slots_copies_their_sequences_and_frees_them_in_the_source(tiny_parts):
    """Slots 1 and 3 of a 4-slot group with a 64-position window move into slots 0 and 5 of an 8-slot group with
    128 positions: their cache prefix, lengths, budgets, keys and logits arrive; padding indices change nothing; the
    source slots are no longer active, the others are untouched."""
    cfg, _, tok, model = tiny_parts
    programs = SlotPrograms(model, tok.pad_id, (tok.eos_id,), 1.0, 4)
    rng = np.random.default_rng(0)

    def filled(size, window):
        st = programs.empty(size=size, window=window)
        return st.replace(cache=tuple((jnp.asarray(rng.standard_normal(k.shape), k.dtype),
                                       jnp.asarray(rng.standard_normal(v.shape), v.dtype)) for k, v in st.cache),
                          length=jnp.arange(size, dtype=jnp.int32) + 10, budget=jnp.full((size,), 30, jnp.int32),
                          active=jnp.ones((size,), bool), last_logits=jnp.asarray(rng.standard_normal(
                              st.last_logits.shape), jnp.float32))

    src, dst = filled(4, 64), filled(8, 128)
    before_src, before_dst = jax.device_get(src), jax.device_get(dst)
    moved, src_active = programs.move(src, dst, jnp.asarray([1, 3, 4, 4], jnp.int32),
                                       jnp.asarray([0, 5, 8, 8], jnp.int32))
    moved = jax.device_get(moved)
    assert window_of(moved) == 128 and src_active.tolist() == [True, False, True, False]
    for s, d in ((1, 0), (3, 5)):
        for (mk, mv), (sk, sv) in zip(moved.cache, before_src.cache):
            np.testing.assert_array_equal(mk[d, ..., :64], sk[s])
            np.testing.assert_array_equal(mv[d, :, :64], sv[s])
        assert moved.length[d] == before_src.length[s]
        np.testing.assert_array_equal(moved.last_logits[d], before_src.last_logits[s])
    for d in (1, 2, 3, 4, 6, 7):
        np.testing.assert_array_equal(moved.cache[0][0][d], before_dst.cache[0][0][d])
        assert moved.length[d] == before_dst.length[d]


def test_a_prefill_holds_one_positions_logits_a_prompt_not_every_positions(small_cfg):
    """The prefill computed float32 logits over the vocabulary at every prompt position and kept the last: on
    Qwen2.5-1.5B's preset (256 rows, 512-token prompts) that was 9.3 of the prefill's 14.8 GiB peak, the sampler's
    largest program (`grpo-stream plan`). Its temporaries now stay well below one [prompts, positions, vocab] array."""
    from grpo_stream.common.model.policy import build_model

    vocab, prompts, width = 4096, 16, 128
    programs = SlotPrograms(build_model(small_cfg.model, vocab, seed=0), 0, (1,), 1.0, 4)
    model = programs.model
    weights = jax.eval_shape(programs.relayout, model.params)
    compiled = programs.prefill.lower(weights, jax.ShapeDtypeStruct((prompts, width), jnp.int32),
                                      jax.ShapeDtypeStruct((prompts,), jnp.int32)).compile()
    every_position = prompts * width * vocab * 4
    assert compiled.memory_analysis().temp_size_in_bytes < every_position / 2
