"""Parity of our objective with Tunix 0.1.7 `algo_core.grpo_loss_fn` (the reference implementation).

Both sides get the same per-token logprobs (Tunix's `compute_per_token_logps` on a tiny
random model), so this compares the objectives: loss and gradient with respect to every
model parameter, for each combination both support. Inputs are drawn with a fresh seed on
every run: random prompt lengths (left padding), completion lengths (EOS, then padding),
advantages and old/behaviour logprob offsets.
"""

import itertools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from tunix.rl import algo_core
from tunix.rl import common as tunix_common

from grpo_stream.trainer_service.learning.loss import AGG_MODES, policy_loss

PAD, EOS, VOCAB, TEMPERATURE = 0, 1, 48, 0.9
KL_MODES = {"k1": "kl", "k2": "mse_kl", "k3": "low_var_kl"}


@pytest.fixture(scope="module")
def tiny_model():
    cfg = qwen3.ModelConfig(num_layers=1, vocab_size=VOCAB, embed_dim=16, hidden_dim=32, num_heads=2, head_dim=8,
                            num_kv_heads=1, rope_theta=10_000, norm_eps=1e-6)
    return nnx.split(qwen3.Qwen3(cfg, rngs=nnx.Rngs(3)))


def draw_inputs(rng, batch, prompt_len, completion_len):
    prompts = np.full((batch, prompt_len), PAD, np.int32)
    completions = np.full((batch, completion_len), PAD, np.int32)
    mask = np.zeros((batch, completion_len), np.float32)
    for i in range(batch):
        p = rng.integers(1, prompt_len + 1)
        prompts[i, prompt_len - p:] = rng.integers(2, VOCAB, p)
        c = rng.integers(1, completion_len + 1)
        completions[i, :c] = rng.integers(2, VOCAB, c)
        if rng.random() < 0.7:  # most completions end with EOS, the rest hit the limit
            completions[i, c - 1] = EOS
        mask[i, :c] = 1.0
    return dict(prompt_ids=jnp.asarray(prompts), prompt_mask=jnp.asarray(prompts != PAD),
                completion_ids=jnp.asarray(completions), completion_mask=jnp.asarray(mask),
                advantages=jnp.asarray(rng.standard_normal(batch).astype(np.float32)))


def run_case(graphdef, state, data, loss_algo, agg_mode, kl, with_weights, rng):
    logps = tunix_common.compute_per_token_logps(graphdef, state, data["prompt_ids"], data["completion_ids"], PAD, EOS,
                                                 temperature=TEMPERATURE)
    shape = logps.shape
    old = logps + jnp.asarray(rng.normal(0, 0.15, shape).astype(np.float32))
    ref = logps + jnp.asarray(rng.normal(0, 0.3, shape).astype(np.float32)) if kl else None
    weights = jnp.asarray(rng.uniform(0.3, 2.0, shape).astype(np.float32)) if with_weights else None
    beta = 0.05 if kl else 0.0
    config = types.SimpleNamespace(beta=beta, epsilon=0.2, epsilon_high=0.28, epsilon_c=None, loss_algo=loss_algo,
                                   loss_agg_mode=agg_mode, temperature=TEMPERATURE,
                                   kl_loss_mode=KL_MODES.get(kl, "kl"), kl_clamp_value=None)
    example = algo_core.common.TrainExample(ref_per_token_logps=ref, old_per_token_logps=old,
                                            sampler_is_weights=weights, **data)

    def theirs(st):
        return algo_core.grpo_loss_fn(nnx.merge(graphdef, st), example, config, PAD, EOS)[0]

    def ours(st):
        lp = tunix_common.compute_per_token_logps(graphdef, st, data["prompt_ids"], data["completion_ids"], PAD, EOS,
                                                  stop_gradient=False, temperature=TEMPERATURE)
        return policy_loss(lp, old, data["advantages"], data["completion_mask"], loss_algo=loss_algo, eps_low=0.2,
                           eps_high=0.28, agg_mode=agg_mode, is_weights=weights, ref_logprobs=ref, beta=beta,
                           kl_estimator=kl or "k3")[0]

    return jax.value_and_grad(theirs)(state), jax.value_and_grad(ours)(state)


COMBOS = list(itertools.product(["grpo", "gspo-token"], AGG_MODES, [None, "k1", "k2", "k3"], [False, True]))


# every combination on one general shape in the default lane; the other shapes (a batch of 7 with short prompts,
# one-token completions) in -m heavy: each shape runs every combination (about 15 s of a worker)
@pytest.mark.parametrize("shape", [(4, 6, 5), pytest.param((7, 3, 9), marks=pytest.mark.heavy),
                                   pytest.param((2, 9, 1), marks=pytest.mark.heavy)],
                         ids=lambda s: "x".join(map(str, s)))
def test_loss_and_gradient_match_tunix(tiny_model, shape):
    graphdef, state = tiny_model
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    data = draw_inputs(rng, *shape)
    for loss_algo, agg_mode, kl, with_weights in COMBOS:
        case = f"seed={seed} {loss_algo} {agg_mode} kl={kl} weights={with_weights}"
        (loss_t, grad_t), (loss_o, grad_o) = run_case(graphdef, state, data, loss_algo, agg_mode, kl, with_weights,
                                                      rng)
        assert abs(float(loss_o) - float(loss_t)) <= 1e-5 * max(abs(float(loss_t)), 1e-3), case
        leaves_t, leaves_o = jax.tree_util.tree_leaves(grad_t), jax.tree_util.tree_leaves(grad_o)
        scale = max(float(jnp.abs(g).max()) for g in leaves_t)
        for gt, go in zip(leaves_t, leaves_o):
            np.testing.assert_allclose(np.asarray(go), np.asarray(gt), rtol=1e-5, atol=1e-5 * scale, err_msg=case)


def test_on_policy_case_matches_tunix(tiny_model):
    """old_per_token_logps=None in Tunix is our old_logprobs=None: ratio exactly 1."""
    graphdef, state = tiny_model
    rng = np.random.default_rng()
    data = draw_inputs(rng, 5, 4, 6)
    config = types.SimpleNamespace(beta=0.0, epsilon=0.2, epsilon_high=0.2, epsilon_c=None, loss_algo="grpo",
                                   loss_agg_mode="token-mean", temperature=TEMPERATURE, kl_loss_mode="kl",
                                   kl_clamp_value=None)
    example = algo_core.common.TrainExample(ref_per_token_logps=None, old_per_token_logps=None, **data)
    loss_t, aux = algo_core.grpo_loss_fn(nnx.merge(graphdef, state), example, config, PAD, EOS)
    lp = tunix_common.compute_per_token_logps(graphdef, state, data["prompt_ids"], data["completion_ids"], PAD, EOS,
                                              temperature=TEMPERATURE)
    loss_o, m = policy_loss(lp, None, data["advantages"], data["completion_mask"], loss_algo="grpo", eps_low=0.2,
                            eps_high=0.2, agg_mode="token-mean")
    assert abs(float(loss_o) - float(loss_t)) <= 1e-6 and float(m["ratio_max"]) == 1.0
    assert float(aux["is_ratio/max"]) == 1.0
