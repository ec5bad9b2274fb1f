"""The RL update with a real tiny model and real engine rollouts."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.trainer_service.learning.batching import build_batch
from grpo_stream.trainer_service.learning.packing import packing_layout
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater, summarise


@pytest.fixture(scope="module")
def rollout(tiny_parts):
    """Groups sampled by the engine with the model's own weights (staleness 0)."""
    cfg, task, tok, model = tiny_parts
    gen = cfg.generation
    engine = ContinuousEngine(model, tok.pad_id, tok.eos_id, gen.max_prompt_tokens, gen.max_new_tokens, gen.temperature)
    n, problems = gen.num_generations, [task.train_problem(i) for i in range(4)]
    prompts = [tok.encode(p.prompt) for p in problems]
    out = engine.generate(model.params, [ids for ids in prompts for _ in range(n)], jax.random.key(0))
    rng = np.random.default_rng(0)
    groups = []
    for k, ids in enumerate(prompts):
        comps = [CompletionData(out.tokens[j, :out.lengths[j]], out.logprobs[j, :out.lengths[j]],
                                float(rng.integers(0, 2)), not out.finished[j]) for j in range(k * n, (k + 1) * n)]
        comps[0].reward, comps[1].reward = 1.0, 0.0  # every group has signal
        groups.append(GroupData(f"g{k}", f"p{k}", np.array(ids, np.int32), comps, 0, "s"))
    return groups


def make(tiny_parts, rollout, **algo):
    cfg, _, tok, model = tiny_parts
    a = AlgoSection(**algo)
    batch, _ = build_batch(rollout, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens, tok.pad_id, a,
                           held_version=0)
    return PolicyUpdater(model, model.params, a, 1e-3, 1.0, cfg.generation.temperature, tok.pad_id,
                         packing_layout(cfg, 1)), batch


def test_zero_staleness_one_pass_ratio_is_one_and_weights_are_one(tiny_parts, rollout):
    updater, batch = make(tiny_parts, rollout, tis_cap=2.0)
    m = updater.update(batch)
    assert m["ratio_min"] == m["ratio_max"] == 1.0
    assert abs(m["is_weight_mean"] - 1.0) < 1e-5 and abs(m["is_weight_min"] - 1.0) < 1e-5
    # sampler-trainer agreement at version lag 0, float32
    assert m["fresh_tokens"] > 0 and m["logprob_diff_mean"] < 1e-5 and m["logprob_diff_max"] < 1e-4
    assert m["optimizer_steps"] == 1


def test_several_passes_use_old_logprobs_from_before_the_first_update(tiny_parts, rollout):
    updater, batch = make(tiny_parts, rollout, num_iterations=2, minibatches=2)
    before = jax.tree_util.tree_leaves(updater.params)[0].copy()
    m = updater.update(batch)
    assert m["optimizer_steps"] == 4
    assert m["ratio_max"] > 1.0 or m["ratio_min"] < 1.0  # later minibatches are off the old policy
    assert not np.array_equal(before, jax.tree_util.tree_leaves(updater.params)[0])


def _live_bytes():
    # earlier tests' arrays in this worker that only the cycle collector frees would otherwise be freed between two
    # readings at its whim (a reading once came out 1.5 MB lower than the one before it)
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def test_beta_zero_holds_no_reference_model(tiny_parts, rollout):
    _, _, _, model = tiny_parts
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    start = _live_bytes()
    plain, _ = make(tiny_parts, rollout, beta=0.0)
    plain_bytes = _live_bytes() - start
    assert plain.ref_params is None
    start = _live_bytes()
    with_ref, batch = make(tiny_parts, rollout, beta=0.1)
    ref_bytes = _live_bytes() - start
    assert with_ref.ref_params is not None
    # the reference costs exactly one more copy of the parameters (measured on live device buffers);
    # the batch built by `make` is the same size both times
    assert ref_bytes - plain_bytes == param_bytes
    m = with_ref.update(batch)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)  # reference == policy before the first update


def test_donation_updates_in_place_with_the_same_result(tiny_parts, rollout):
    """With donation the update step writes the new parameters and optimizer state over the old buffers: the same
    numbers as without, the replaced parameters are gone, and no second copy of the state stays alive."""
    cfg, _, tok, model = tiny_parts
    a = AlgoSection(num_iterations=2, minibatches=2)
    batch, _ = build_batch(rollout, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens, tok.pad_id, a,
                           held_version=0)
    results = {}
    for donate in (False, True):
        params = jax.tree.map(jnp.copy, model.params)  # the fixture's own arrays must survive
        updater = PolicyUpdater(model, params, a, 1e-3, 1.0, cfg.generation.temperature, tok.pad_id,
                                packing_layout(cfg, 1), donate=donate)
        updater.update(batch)  # compiles; then measure a second update
        before = updater.params
        start = _live_bytes()
        updater.update(batch)
        grown = _live_bytes() - start
        assert all(x.is_deleted() for x in jax.tree.leaves(before)) == donate
        results[donate] = (jax.tree.map(np.asarray, updater.params), grown)
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model.params))
    for x, y in zip(jax.tree.leaves(results[False][0]), jax.tree.leaves(results[True][0])):
        np.testing.assert_array_equal(x, y)
    # without donation the caller's old parameters stay alive beside the new ones; with it nothing grows
    assert results[False][1] >= param_bytes and results[True][1] < param_bytes


def test_the_update_step_compiles_once_over_several_steps(tiny_parts, rollout):
    """On a mesh, the step hands back parameters and optimizer state in the layout it took them in: the second
    and later steps reuse the first step's program. (XLA's own output shardings spelt replicated axes differently,
    and the optimizer's step counts started uncommitted, so the whole update compiled twice: minutes on a large
    model.)"""
    from grpo_stream.common.model.sharding import make_mesh, place

    cfg, _, tok, model = tiny_parts
    mesh = make_mesh(1, 1, jax.devices()[:1], "trainer.mesh")
    a = AlgoSection(beta=0.04)
    batch, _ = build_batch(rollout, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens, tok.pad_id, a,
                           held_version=0)
    updater = PolicyUpdater(model, place(jax.tree.map(jnp.copy, model.params), mesh), a, 1e-3, 1.0,
                            cfg.generation.temperature, tok.pad_id, packing_layout(cfg, 1), mesh, donate=True)
    for _ in range(3):
        updater.update(batch)
    assert updater.programs._step._cache_size() == 1
    assert updater.programs._logprobs._cache_size() == 1


def test_the_batch_is_packed_on_the_host_and_placed_once(tiny_parts, rollout, monkeypatch):
    """The step's batch stays numpy from build_batch to the packer, and the update places it with one transfer:
    nothing of it is fetched back from a device (a device_get is the metrics', after the optimizer updates)."""
    cfg, _, tok, model = tiny_parts
    a = AlgoSection(minibatches=2, beta=0.04)
    batch, _ = build_batch(rollout, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens, tok.pad_id, a,
                           held_version=0)
    assert all(isinstance(getattr(batch, f), np.ndarray) for f in ("tokens", "valid", "loss_mask",
                                                                   "behaviour_logprobs", "advantages", "fresh"))
    updater = PolicyUpdater(model, model.params, a, 1e-3, 1.0, cfg.generation.temperature, tok.pad_id,
                            packing_layout(cfg, 1))
    calls = {"device_put": 0, "device_get": 0}
    for name in calls:
        real = getattr(jax, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(jax, name, counted)
    updater.update(batch)
    assert calls == {"device_put": 1, "device_get": 1}


def test_an_update_with_nothing_in_the_loss_leaves_the_weights_and_reports_finite_on_policy_figures(tiny_parts,
                                                                                                   rollout):
    """Every completion filtered (overlong, say): a zero gradient, but Adam's momentum from the step before would
    still move the weights, and the ratio's minimum over no token was +inf (not JSON)."""
    updater, batch = make(tiny_parts, rollout)
    updater.update(batch)  # momentum
    before = [np.array(x) for x in jax.tree_util.tree_leaves(updater.params)]
    m = updater.update(batch.replace(loss_mask=np.zeros_like(batch.loss_mask)))
    after = jax.tree_util.tree_leaves(updater.params)
    assert all(np.array_equal(b, np.array(a)) for b, a in zip(before, after))
    assert m["optimizer_steps"] == 0 and all(np.isfinite(v) for v in m.values())
    assert m["ratio_min"] == m["ratio_mean"] == m["ratio_max"] == 1.0 and m["clip_fraction"] == 0.0


def test_a_minibatch_with_nothing_in_the_loss_is_left_out_of_the_figures():
    steps = [{"ratio_mean": 1.2, "ratio_min": 0.9, "ratio_max": 1.5, "clip_fraction": 0.5, "lp_diff_sum": 0.0,
              "lp_diff_max": 0.0, "fresh_tokens": 0.0},
             {"ratio_mean": 0.0, "ratio_min": float("inf"), "ratio_max": 0.0, "clip_fraction": 0.0,
              "lp_diff_sum": 0.0, "lp_diff_max": 0.0, "fresh_tokens": 0.0}]
    out = summarise(steps, 2, tokens=[40.0, 0.0])
    assert (out["ratio_mean"], out["ratio_min"], out["ratio_max"], out["clip_fraction"]) == (1.2, 0.9, 1.5, 0.5)
    assert out["optimizer_steps"] == 1


def test_token_statistics_are_means_over_the_updates_tokens_and_the_rest_over_its_minibatches():
    """A minibatch of 30 tokens at entropy 1 and one of 10 at entropy 3: the update's tokens' mean entropy is 1.5 (it
    was 2.0, the minibatches' mean, whatever their tokens); the loss and the gradient norm are per optimizer step."""
    def step(entropy, clipped, loss):
        return {"entropy": entropy, "clip_fraction": clipped, "pg_loss": loss, "grad_norm": 2 * loss,
                "ratio_max": 1 + loss, "lp_diff_sum": 0.0, "lp_diff_max": 0.0, "fresh_tokens": 0.0}

    out = summarise([step(1.0, 0.0, 1.0), step(3.0, 0.4, 3.0)], 2, tokens=[30.0, 10.0])
    assert out["entropy"] == pytest.approx(1.5) and out["clip_fraction"] == pytest.approx(0.1)
    assert out["pg_loss"] == pytest.approx(2.0) and out["grad_norm"] == pytest.approx(4.0) and out["ratio_max"] == 4.0
    unweighted = summarise([step(1.0, 0.0, 1.0), step(3.0, 0.4, 3.0)], 2)
    assert unweighted["entropy"] == pytest.approx(2.0)
