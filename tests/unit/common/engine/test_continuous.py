"""The continuous-batching JAX engine: exact behaviour logprobs, slot refill, shared prefill, live-length
attention windows, compaction, and in-flight weight updates with per-token versions."""

import jax
import numpy as np
import pytest

from grpo_stream.bench.static_engine import StaticEngine
from grpo_stream.common.engine.base import FixedRequests, Generation, Request, rows_decoding_mean
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.model.policy import sequence_logprobs
from grpo_stream.trainer_service.learning.batching import layout
from tests.mixed_versions import MixedVersionReference, every_other_call, scaled_versions

NO_EOS = -1  # no token ends a completion: lengths are the budgets


@pytest.fixture(scope="module")
def engine(tiny_parts):
    cfg, task, tok, model = tiny_parts
    return ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens,
                            cfg.generation.max_new_tokens, temperature=0.7, slots=8, chunk_steps=4)


def _prompts(task, tok, n, copies=1):
    return [tok.encode(task.train_problem(i).prompt) for i in range(n) for _ in range(copies)]


def _recomputed(model, params, prompts, out, p, c, pad_id, temperature):
    rows = [layout(np.array(pr), out.tokens[i, :out.lengths[i]], p, c, pad_id) for i, pr in enumerate(prompts)]
    tokens, valid = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    return np.asarray(sequence_logprobs(model, params, tokens, valid, temperature, pad_id))[:, p - 1:]


def test_behaviour_logprobs_equal_the_trainers_recomputation(tiny_parts, engine):
    cfg, task, tok, model = tiny_parts
    prompts = _prompts(task, tok, 6, copies=4)  # 24 rows through 8 slots: refills happen
    out = engine.generate(model.params, prompts, jax.random.key(np.random.randint(1 << 30)))
    p, c = cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens
    recomputed = _recomputed(model, model.params, prompts, out, p, c, tok.pad_id, 0.7)
    diffs = np.concatenate([np.abs(recomputed[i, :n] - out.logprobs[i, :n]) for i, n in enumerate(out.lengths)])
    assert diffs.mean() <= 1e-5 and diffs.max() <= 1e-4
    assert (out.logprobs <= 0).all() and out.versions is None  # one version throughout: none recorded


def test_pad_is_never_sampled_and_eos_ends_completions(tiny_parts, engine):
    cfg, task, tok, model = tiny_parts
    out = engine.generate(model.params, _prompts(task, tok, 16), jax.random.key(1))
    for i in range(16):
        n = out.lengths[i]
        assert tok.pad_id not in out.tokens[i, :n].tolist()
        assert (out.tokens[i, n:] == tok.pad_id).all() and (out.logprobs[i, n:] == 0).all()
        if out.finished[i]:
            assert out.tokens[i, n - 1] == tok.eos_id
        else:
            assert n == cfg.generation.max_new_tokens


def test_results_do_not_depend_on_slots_or_chunks(tiny_parts, engine):
    """Each row samples with its own key: the same tokens whether it ran in 8 slots of 4-step chunks or 3 of 2,
    alone or among other prompts, and greedy ignores the key."""
    cfg, task, tok, model = tiny_parts
    prompts = _prompts(task, tok, 5, copies=3)
    other = ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens,
                             cfg.generation.max_new_tokens, temperature=0.7, slots=3, chunk_steps=2)
    a = engine.generate(model.params, prompts, jax.random.key(5))
    b = other.generate(model.params, prompts, jax.random.key(5))
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    g1 = engine.generate(model.params, prompts, jax.random.key(1), greedy=True)
    g2 = other.generate(model.params, prompts[-1:], jax.random.key(2), greedy=True)
    np.testing.assert_array_equal(g1.tokens[-1], g2.tokens[0])


def test_refilled_slots_finish_one_long_and_many_short_in_few_steps(tiny_parts):
    """One 64-token completion and 31 of 4 tokens through 4 slots: the static engine needs 8 batches of 64 steps
    (512); refilling the slots whose rows ended keeps the short rows flowing beside the long one."""
    cfg, task, tok, model = tiny_parts
    prompts = _prompts(task, tok, 32)
    budgets = [64] + [4] * 31
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, 64, 1.0, slots=4,
                              chunk_steps=8)
    out = engine.generate(model.params, prompts, jax.random.key(0), max_new_tokens=budgets)
    assert out.lengths.tolist() == budgets
    static_steps = -(-len(prompts) // 4) * 64
    assert engine.stats["decode_steps"] <= 64 + 2 * 8 < static_steps // 6
    assert engine.stats["prefill_rows"] == 32
    # every token made counts once; the short rows kept the 4 slots busy most steps, the long one's tail ran alone
    assert 2.3 < rows_decoding_mean(engine) == round(sum(budgets) / engine.stats["decode_steps"], 1) < 4
    # 4 slots are below the compaction floor: the set ran in one slot count, no compaction programs
    assert not any(kind == "compact" for kind, *_ in engine.programs)


def test_rows_decoding_mean_is_the_load_the_engine_was_kept_at(tiny_parts):
    """What a sampler reports of its engine (gpu-check sets it against the engine alone): as many rows as were given
    at once while each runs to the same budget; None for an engine that keeps no counts (vLLM)."""
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, 8, 1.0, slots=8,
                              chunk_steps=4)
    assert rows_decoding_mean(engine) is None  # nothing decoded yet
    engine.generate(model.params, _prompts(task, tok, 6), jax.random.key(0), max_new_tokens=[8] * 6)
    assert rows_decoding_mean(engine) == 6.0
    assert rows_decoding_mean(object()) is None


def test_a_long_tail_is_compacted_into_fewer_slots(tiny_parts):
    """32 rows in 32 slots, one of them long: once the short ones end, the long one's tail runs in ever fewer
    slots, one step of the ladder at a time down to the floor of 8 (one chain of compiled shapes), with the same
    tokens as without compaction."""
    cfg, task, tok, model = tiny_parts
    prompts = _prompts(task, tok, 32)
    budgets = [48] + [4] * 31
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, 48, 1.0, slots=32,
                              chunk_steps=4)
    out = engine.generate(model.params, prompts, jax.random.key(0), max_new_tokens=budgets)
    assert out.lengths.tolist() == budgets
    assert {tuple(p) for p in engine.programs if p[0] == "compact"} == {
        ("compact", 32, 64, 24), ("compact", 24, 64, 16), ("compact", 16, 64, 12), ("compact", 12, 64, 8)}
    assert ("decode", ((8, 64),)) in {p[:2] for p in engine.programs if p[0] == "decode"}
    alone = engine.generate(model.params, prompts[:1], jax.random.key(0), max_new_tokens=budgets[:1])
    np.testing.assert_array_equal(alone.tokens[0], out.tokens[0])


def test_a_group_prefills_its_prompt_once(tiny_parts):
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens,
                              cfg.generation.max_new_tokens, 1.0, slots=16, chunk_steps=4)
    engine.generate(model.params, _prompts(task, tok, 4, copies=4), jax.random.key(0))
    assert engine.stats["prefills"] == 4 and engine.stats["prefill_rows"] == 16


def test_attention_windows_follow_live_lengths(tiny_parts):
    """Short sequences in a long cache attend over a short window; only a long one widens it."""
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, 200, 1.0, slots=4,
                              chunk_steps=8)
    assert engine.cache_len >= 224
    engine.generate(model.params, _prompts(task, tok, 4), jax.random.key(0), max_new_tokens=[8] * 4)
    assert {w for p in engine.programs if p[0] == "decode" for _, w in p[1]} == {64}
    engine.generate(model.params, _prompts(task, tok, 2), jax.random.key(0), max_new_tokens=[200, 8])
    windows = sorted({w for p in engine.programs if p[0] == "decode" for _, w in p[1]})
    assert windows[0] == 64 and windows[-1] == engine.cache_len and len(windows) <= 4
    # the caches grew with the window between chunks (decoding never slices them): 64 -> ... -> cache_len
    grown = sorted((old, new) for kind, _, old, new in (p for p in engine.programs if p[0] == "resize") if new > old)
    assert [new for _, new in grown] == windows[1:] and grown[0][0] == 64


def test_in_flight_updates_record_the_version_of_every_token(tiny_parts):
    """A clearly different version every other chunk: live slots go on with the new weights, every token records
    the version whose weights drew it, and its logprob is that version's (recomputed one token at a time)."""
    cfg, task, tok, model = tiny_parts
    p, c = cfg.generation.max_prompt_tokens, 16
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, p, c, 1.0, slots=4, chunk_steps=2)
    versions = scaled_versions(model.params, 10, 0.3)
    prompts = _prompts(task, tok, 6)  # 6 rows in 4 slots: rows admitted under later versions too
    budgets = [c, c, 9, c, 5, c]
    out = engine.generate(model.params, prompts, jax.random.key(0), max_new_tokens=budgets,
                          refresh=every_other_call(versions))
    assert out.lengths.tolist() == budgets
    recorded = [out.versions[i, :n] for i, n in enumerate(budgets)]
    assert all((np.diff(v) >= 0).all() for v in recorded)
    assert sum(len(np.unique(v)) > 1 for v in recorded) >= 4  # versions changed mid-sequence
    # one reference for every row, its cache as long as the longest: the versions' decode layouts are made and its
    # step compiled once, not once per row and length (positions past a row's own are masked out of its attention)
    mixed = MixedVersionReference(model, versions, p + c)
    for i, n in enumerate(budgets):
        tokens = out.tokens[i, :n].tolist()
        reference = mixed(prompts[i], tokens, recorded[i].tolist(), 1.0, tok.pad_id)
        np.testing.assert_allclose(out.logprobs[i, :n], reference, atol=1e-4)
        # the newest weights alone would give other logprobs: the versions are clearly different
        if len(np.unique(recorded[i])) > 1:
            newest = mixed(prompts[i], tokens, [int(recorded[i][-1])] * n, 1.0, tok.pad_id)
            assert np.abs(reference - newest).max() > 1e-2


def test_budgets_and_prompts_are_checked(tiny_parts, engine):
    cfg, _, _, model = tiny_parts
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        engine.generate(model.params, [[5] * (cfg.generation.max_prompt_tokens + 1)], jax.random.key(0))
    with pytest.raises(ValueError, match="generation.max_new_tokens"):
        engine.generate(model.params, [[5, 6]], jax.random.key(0), max_new_tokens=[cfg.generation.max_new_tokens + 1])


def test_the_static_baseline_generates_the_same_distribution_interface(tiny_parts):
    """The benchmark's baseline honours per-row budgets and returns the policy's logprobs too."""
    cfg, task, tok, model = tiny_parts
    p, c = cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens
    static = StaticEngine(model, tok.pad_id, NO_EOS, p, c, 0.7)
    prompts = _prompts(task, tok, 4)
    out = static.generate(model.params, prompts, jax.random.key(3), max_new_tokens=[3, 5, c, 1])
    assert out.lengths.tolist() == [3, 5, c, 1]
    recomputed = _recomputed(model, model.params, prompts, out, p, c, tok.pad_id, 0.7)
    for i, n in enumerate(out.lengths):
        np.testing.assert_allclose(recomputed[i, :n], out.logprobs[i, :n], atol=1e-4)


def test_named_numpy_roundtrip(tiny_parts):
    _, _, _, model = tiny_parts
    named = model.to_named_numpy()
    assert "layers.0.attn.q_proj.w" in named
    back = model.to_named_numpy(model.from_named_numpy(named))
    for k in named:
        np.testing.assert_array_equal(named[k], back[k])
    bad = dict(named)
    bad["layers.0.attn.q_proj.w"] = bad["layers.0.attn.q_proj.w"][:1]
    with pytest.raises(ValueError, match="layers.0.attn.q_proj.w"):
        model.from_named_numpy(bad)


def _engine(tiny_parts, slots, chunk_steps, max_new, groups):
    cfg, _, tok, model = tiny_parts
    return ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, max_new, 1.0, slots=slots,
                            chunk_steps=chunk_steps, length_groups=groups)


@pytest.mark.heavy  # generation.decode_length_groups=2 is off by default (BENCHMARKS.md): its check is in the heavy lane
def test_long_sequences_move_to_a_long_window_group(tiny_parts):
    """Two 200-token completions among 600 short ones in 64 slots: once the long ones outgrow the short ones'
    window they move to a group of their own instead of making 64 slots attend over their length. Same tokens and
    logprobs as with one group, exact against the trainer, and far fewer cache positions read (counted)."""
    cfg, task, tok, model = tiny_parts
    prompts = _prompts(task, tok, 602)
    budgets = [200, 200] + [4 + i % 24 for i in range(600)]
    runs = {}
    for groups in (1, 2):
        engine = _engine(tiny_parts, 64, 8, 200, groups)
        runs[groups] = (engine.generate(model.params, prompts, jax.random.key(4), max_new_tokens=budgets),
                        engine.stats)
    (one, one_stats), (two, two_stats) = runs[1], runs[2]
    assert two.lengths.tolist() == budgets
    np.testing.assert_array_equal(one.tokens, two.tokens)
    np.testing.assert_allclose(one.logprobs, two.logprobs, atol=1e-5)
    assert two_stats["moved_rows"] >= 2 and one_stats["moved_rows"] == 0
    assert two_stats["cache_positions_read"] < 0.6 * one_stats["cache_positions_read"]
    recomputed = _recomputed(model, model.params, prompts[:2], two, cfg.generation.max_prompt_tokens, 200,
                             tok.pad_id, 1.0)
    diffs = np.abs(recomputed[:, :200] - two.logprobs[:2])
    assert diffs.mean() <= 1e-5 and diffs.max() <= 1e-4


def test_groups_merge_when_two_would_exceed_the_cache_memory(tiny_parts):
    """With no row work in the cost model (it then prefers moving whenever that saves positions), 32 long
    rows with staggered prompt lengths in 32 slots move to the long group as they outgrow the window, until two groups would
    hold more than 32 whole sequences' cache: then they merge. The cache never exceeds that memory, and the tokens are those of one group."""
    _, task, tok, model = tiny_parts
    prompts = [(p * 2)[:3 + i % 21] for i, p in enumerate(_prompts(task, tok, 32))]  # staggered lengths
    budgets = [120] * 32
    two = _engine(tiny_parts, 32, 4, 120, 2)
    two.table.row_work = 0.0  # the cost model lives in the slot table
    out = two.generate(model.params, prompts, jax.random.key(9), max_new_tokens=budgets)
    assert out.lengths.tolist() == budgets
    one = _engine(tiny_parts, 32, 4, 120, 1).generate(model.params, prompts, jax.random.key(9),
                                                       max_new_tokens=budgets)
    np.testing.assert_array_equal(out.tokens, one.tokens)
    assert two.stats["moved_rows"] > 0 and two.stats["merges"] >= 1
    assert two.stats["peak_cache_positions"] <= 32 * two.cache_len


def test_an_in_flight_update_holds_one_decode_layout_at_a_time(tiny_parts):
    """When a new version arrives mid-serve, the previous version's decode layout is freed before the new one is made
    (a second layout of a large model is what its memory plan has no room for)."""
    import weakref

    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, 16, 1.0, slots=4,
                              chunk_steps=2)
    relayout, made, alive_at_relayout = engine.device.relayout, [], []

    def recorded(params):
        alive_at_relayout.append(sum(ref() is not None for ref in made))
        out = relayout(params)
        made.extend(weakref.ref(leaf) for leaf in jax.tree_util.tree_leaves(out))
        return out

    engine.device.relayout = recorded
    versions = scaled_versions(model.params, 4, 0.3)
    engine.generate(model.params, _prompts(task, tok, 4), jax.random.key(0), max_new_tokens=[16] * 4,
                    refresh=every_other_call(versions))
    assert len(alive_at_relayout) >= 3, alive_at_relayout  # the first version and at least two updates
    assert alive_at_relayout == [0] * len(alive_at_relayout)


def test_release_drops_the_weights_their_layout_and_the_caches_of_the_last_serve(tiny_parts):
    """The trainer's evaluation engine kept the evaluated snapshot, its decode copy and the last serve's caches on the
    devices beside training until its next evaluation: release() (which the trainer calls after each) frees them."""
    cfg, task, tok, model = tiny_parts
    engine = ContinuousEngine(model, tok.pad_id, tok.eos_id, cfg.generation.max_prompt_tokens,
                              cfg.generation.max_new_tokens, 1.0, slots=8)
    prompts = [tok.encode(task.train_problem(i).prompt) for i in range(8)]
    live = lambda: sum(a.nbytes for a in jax.live_arrays())  # noqa: E731
    snapshot = jax.tree.map(jax.numpy.copy, model.params)
    jax.block_until_ready(snapshot)
    before = live()
    out = engine.generate(snapshot, prompts, jax.random.key(0))
    del out, snapshot
    held = live() - before
    engine.release()
    freed = held - (live() - before)
    snapshot_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    assert freed >= snapshot_bytes, (held, freed, snapshot_bytes)  # at least the snapshot itself went
    assert live() - before <= -snapshot_bytes + 1024  # and nothing of the serve stayed (beyond a few scalars)
    engine.generate(model.params, prompts, jax.random.key(0))  # usable again


def test_a_request_that_does_not_fit_the_cache_names_the_setting_that_sized_it(tiny_parts):
    """An engine whose cache the endpoint's context sized refuses a longer request by naming that setting (not the
    rollouts' prompt + completion), and a budget past generation.max_new_tokens by naming that one."""
    cfg, _, tok, model = tiny_parts
    c = cfg.generation.max_new_tokens
    engine = ContinuousEngine(model, tok.pad_id, NO_EOS, cfg.generation.max_prompt_tokens, c, 1.0, slots=4,
                              context_tokens=100, context_field="sampler.openai.max_context_tokens")
    key = engine.request_keys(jax.random.key(0), 1)[0]
    out = Generation(np.zeros((1, c), np.int32), np.zeros((1, c), np.float32), np.zeros(1, np.int32),
                     np.zeros(1, np.bool_))
    too_long = Request([5] * (engine.cache_len - c + 1), c, key, 0)
    with pytest.raises(ValueError, match=r"\(sampler\.openai\.max_context_tokens\); shorten"):
        engine.serve(model.params, FixedRequests([too_long], out))
    with pytest.raises(ValueError, match=r"outside 1\.\.\d+ \(generation\.max_new_tokens\)"):
        engine.serve(model.params, FixedRequests([Request([5, 6], c + 1, key, 0)], out))
