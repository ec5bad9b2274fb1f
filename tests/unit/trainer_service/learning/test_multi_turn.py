"""Multi-turn completions in the update: observation tokens (written by an environment between the model's turns,
CompletionData.model_mask 0) stay in the sequences the model reads but carry no loss, one sequence a row and in
packed rows, for GRPO and for GSPO (whose sequence ratio averages over the model's tokens only), and the
sampler-trainer agreement and off-policy diagnostics count the model's tokens only.

The reference below is written from the objective's definitions (trainer_service/learning/loss.py) with plain Python
loops over each completion's model tokens, found from the completions' masks, not from the batch's loss mask."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.model.policy import sequence_logprobs
from grpo_stream.common.rollouts.wire import CompletionData, GroupData
from grpo_stream.trainer_service.learning.batching import build_batch
from grpo_stream.trainer_service.learning.off_policy_health import group_index_of, importance_diagnostics
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater
from tests.unit.trainer_service.learning.packing_cases import COMPLETION, PROMPT, VOCAB, layout, noisy, one_a_row, random_model

# Each completion as (model turn, observation) lengths, alternating from the model's first turn: two groups of three
# completions, multi-turn ones (one ending on an observation: the episode's turn limit) beside single-turn ones.
TURNS = [[(5, 4), (6, 3), (2, 0)], [(8, 0)], [(3, 5)], [(4, 2), (7, 0)], [(2, 6), (3, 4), (1, 0)], [(9, 0)]]
ALGOS = {"grpo": AlgoSection(loss_algo="grpo", tis_cap=2.0),
         "gspo-token": AlgoSection(loss_algo="gspo-token")}  # its own clip, 3e-4 / 4e-4


def model_mask(turns) -> np.ndarray:
    return np.concatenate([np.r_[np.ones(m, np.bool_), np.zeros(o, np.bool_)] for m, o in turns])


def groups(seed: int = 0) -> list[GroupData]:
    """Two groups at version 0 (fresh for a trainer holding 0); observation tokens carry logprob 0, as on the
    wire. The second completion says nothing of its tokens (single-turn), the last says all are the model's."""
    rng = np.random.default_rng(seed)
    completions = []
    for i, turns in enumerate(TURNS):
        mask = model_mask(turns)
        logprobs = np.where(mask, -rng.uniform(0.5, 3.0, mask.size), 0.0).astype(np.float32)
        completions.append(CompletionData(rng.integers(1, VOCAB, mask.size).astype(np.int32), logprobs,
                                          float(rng.normal()), False, model_mask=None if i == 1 else mask))
    return [GroupData(f"g{k}", f"p{k}", rng.integers(1, VOCAB, 3 + 4 * k).astype(np.int32),
                      completions[3 * k:3 * k + 3], 0, "s") for k in range(2)]


def model_positions(gs: list[GroupData]) -> list[np.ndarray]:
    """Per row, the logprob positions of the model's tokens in the padded layout (completion token j at P - 1 + j)."""
    return [PROMPT - 1 + np.flatnonzero(c.model_tokens()) for g in gs for c in g.completions]


@functools.cache
def forward():
    """The model's padded rows' log-probs, compiled once for the file (every batch here has the same shape), where
    eight eager calls ran op by op."""
    return jax.jit(lambda params, tokens, valid: sequence_logprobs(random_model(), params, tokens, valid, 1.0, 0))


def setup(loss_algo: str, packing: bool):
    """(updater in packed rows or one sequence a row, batch with behaviour logprobs near the policy's on the model's
    tokens, old (proximal) params, groups): the trained weights, the old and the behaviour policy all differ."""
    model, gs, algo = random_model(), groups(), ALGOS[loss_algo]
    batch, _ = build_batch(gs, PROMPT, COMPLETION, 0, algo, held_version=0)
    rows = layout(rows=2, sequences=6) if packing else one_a_row(rows=2, sequences=6)
    updater = PolicyUpdater(model, model.params, algo, 1e-2, 1.0, 1.0, 0, rows)
    start = np.asarray(forward()(model.params, batch.tokens, batch.valid))
    shift = np.random.default_rng(1).normal(0.0, 0.2, batch.loss_mask.shape).astype(np.float32)
    behaviour = (start + shift) * batch.loss_mask  # 0 on observation tokens, as build_batch leaves them
    return updater, batch.replace(behaviour_logprobs=behaviour), noisy(model.params, 1, 0.05), gs


def reference_loss(params, model, batch, old_params, positions, algo: AlgoSection):
    """Token-mean of the per-token objective over the model's tokens, written out sequence by sequence: GRPO's
    clipped ratio against the old policy times min(exp(o - b), tis_cap); GSPO-token's exp(l - sg(l) + sg(s_i)) with
    s_i the mean of l - b over the sequence's model tokens."""
    l = sequence_logprobs(model, params, batch.tokens, batch.valid, 1.0, 0)
    o = sequence_logprobs(model, old_params, batch.tokens, batch.valid, 1.0, 0)
    b, adv = batch.behaviour_logprobs, batch.advantages
    total, count = 0.0, sum(len(p) for p in positions)
    for i, at in enumerate(positions):
        li, oi, bi, a = l[i, at], o[i, at], b[i, at], adv[i]
        if algo.loss_algo == "gspo-token":
            s = jax.lax.stop_gradient(jnp.mean(li - bi))
            ratio, weight = jnp.exp(li - jax.lax.stop_gradient(li) + s), 1.0
        else:
            ratio, weight = jnp.exp(li - oi), jnp.minimum(jnp.exp(oi - bi), algo.tis_cap)
        per_token = jnp.maximum(-a * ratio, -a * jnp.clip(ratio, 1 - algo.eps_low, 1 + algo.eps_high)) * weight
        total = total + per_token.sum()
    return total / count


@functools.cache
def reference_program(loss_algo: str):
    """reference_loss's value and gradient compiled whole (the model, the groups' model tokens and the settings
    fixed; op by op, the file took 35 s instead of 26), once an algorithm: the reference does not depend on the
    update's layout, so its packed and one-a-row cases share it."""
    model, positions, algo = random_model(), model_positions(groups()), ALGOS[loss_algo]
    return jax.jit(jax.value_and_grad(lambda p, b, o: reference_loss(p, model, b, o, positions, algo)))


def relative_gap(a, b) -> float:
    return float(optax.global_norm(jax.tree.map(jnp.subtract, a, b))) / float(optax.global_norm(b))


@pytest.mark.parametrize("packing", [False, True], ids=["one-a-row", "packed"])
@pytest.mark.parametrize("loss_algo", list(ALGOS))
def test_observation_tokens_carry_no_loss(loss_algo, packing):
    updater, batch, old_params, gs = setup(loss_algo, packing)
    model = updater.model
    grads, metrics = updater.minibatch_gradients(batch, old_params)
    positions = model_positions(gs)
    want_loss, want_grads = reference_program(loss_algo)(model.params, batch, old_params)
    assert float(metrics["loss"]) == pytest.approx(float(want_loss), rel=1e-5)
    assert relative_gap(grads, want_grads) < 1e-5
    assert 0 < float(metrics["clip_fraction"]) < 1  # the clip is at work on some tokens, not all
    # what observation tokens' behaviour logprobs hold does not matter; a model token's does
    completion = np.zeros(batch.loss_mask.shape, np.bool_)
    completion[:, PROMPT - 1:] = np.asarray(batch.valid)[:, PROMPT:]
    observation = completion & (np.asarray(batch.loss_mask) == 0)
    assert observation.sum() == sum(o for turns in TURNS for _, o in turns)
    noise = np.random.default_rng(2).uniform(-5.0, 0.0, observation.shape).astype(np.float32)
    other = batch.replace(behaviour_logprobs=batch.behaviour_logprobs + noise * observation)
    grads_other, metrics_other = updater.minibatch_gradients(other, old_params)
    assert relative_gap(grads_other, grads) == 0.0
    assert all(float(metrics_other[k]) == float(v) for k, v in metrics.items()), metrics_other
    last = (np.arange(len(positions)), np.array([at[-1] for at in positions]))  # each completion's last model token
    behaviour = batch.behaviour_logprobs.copy()
    behaviour[last] -= 0.5
    grads_moved, metrics_moved = updater.minibatch_gradients(batch.replace(behaviour_logprobs=behaviour), old_params)
    assert relative_gap(grads_moved, grads) > 1e-4 and float(metrics_moved["loss"]) != float(metrics["loss"])


@pytest.mark.parametrize("packing", [False, True], ids=["one-a-row", "packed"])
def test_agreement_and_diagnostics_count_the_models_tokens_only(packing):
    """A whole update (PolicyUpdater.update) of fresh sequences: the lag-0 logprob agreement (fresh_tokens,
    logprob_diff_mean/max) and the importance diagnostics are those of the model's tokens; the observation tokens'
    behaviour logprob 0 is far from the policy's, so counting them would show."""
    updater, batch, _, gs = setup("grpo", packing)
    start = np.asarray(forward()(updater.params, batch.tokens, batch.valid))
    positions = model_positions(gs)
    diffs = np.concatenate([np.abs(start[i, at] - np.asarray(batch.behaviour_logprobs)[i, at])
                            for i, at in enumerate(positions)])
    model_only = np.zeros(start.shape, np.float32)
    for i, at in enumerate(positions):
        model_only[i, at] = 1.0
    index = group_index_of(gs)
    want = importance_diagnostics((start - np.asarray(batch.behaviour_logprobs)) * model_only, model_only, index, 2.0)
    got = updater.update(batch, index)
    assert got["fresh_tokens"] == sum(m for turns in TURNS for m, _ in turns) == diffs.size
    assert got["logprob_diff_mean"] == pytest.approx(float(diffs.mean()), rel=1e-4)
    assert got["logprob_diff_max"] == pytest.approx(float(diffs.max()), rel=1e-4)
    assert got["logprob_diff_max"] < 1.0  # the behaviour is near the policy on the model's tokens
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
