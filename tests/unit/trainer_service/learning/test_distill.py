"""On-policy distillation in the update: the per-token reverse-KL advantage -kl_coef * (o - t) (+ reward_weight *
A_i), its loss, its gradient and its metrics through the update's packed rows and its one-sequence-a-row case,
against a reference written in plain numpy from docs/objective.md (every sequence in its own padded row; the model's
part of the gradient is the vector-Jacobian product of the padded rows' log-probs with the numpy dL/dl), on random
batches and on multi-turn completions whose observation tokens are not distilled, for GRPO (clip, TIS) and GSPO, a
full and a LoRA student, and a teacher of another (larger) shape than the student."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_stream.common.config.learning import AlgoSection, DistillSection, LoraSection, TinyModelSection
from grpo_stream.common.model.lora import apply_lora
from grpo_stream.common.model.policy import sequence_logprobs
from grpo_stream.trainer_service.learning.batching import build_batch
from grpo_stream.trainer_service.learning.distill import Teacher
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater
from tests.unit.trainer_service.learning.packing_cases import (COMPLETION, PROMPT, VOCAB, layout, noisy, one_a_row,
                                                               random_batch, random_model, random_weights_model)
from tests.unit.trainer_service.learning.test_multi_turn import groups as multi_turn_groups

DISTILL = DistillSection(teacher="teacher-dir", kl_coef=0.7, reward_weight=0.5)
ALGOS = {"grpo": AlgoSection(loss_algo="grpo", tis_cap=2.0), "gspo-token": AlgoSection(loss_algo="gspo-token")}


@functools.cache  # built once for the file (its init programs: ~10 s a test, loaded): never updated or donated
def teacher_model() -> Teacher:
    """A teacher larger than the student (two layers, wider), every weight random, over the same vocabulary."""
    model = random_weights_model(TinyModelSection(vocab_size=VOCAB, num_layers=2, embed_dim=48, hidden_dim=96,
                                                  num_heads=4, num_kv_heads=2, head_dim=16), seed=7, scale=0.3)
    return Teacher(model, "teacher-dir")


@functools.cache  # the update copies what it trains (donate off): the same student serves every test
def student(lora: bool):
    model = random_model()
    if not lora:
        return model, model.params, None
    adapted = apply_lora(model, model.params, LoraSection(rank=4, alpha=8.0), seed=1)
    return adapted.adapted, noisy(adapted.adapted.params, 3, 0.05), adapted.trainable()


def batch_of(kind: str, algo: AlgoSection):
    if kind == "random":  # long-tailed, some sequences empty or masked out (overlong filter), mixed freshness
        return random_batch(4, n=12)
    batch, _ = build_batch(multi_turn_groups(), PROMPT, COMPLETION, 0, algo, held_version=0)
    return batch


def numpy_reference(l, o, t, b, mask, adv, algo: AlgoSection, d: DistillSection):
    """(loss, dloss/dl, k) of the token-mean objective in numpy, from docs/objective.md's formulas."""
    k = o - t
    a = d.reward_weight * adv[:, None] - d.kl_coef * k
    n = mask.sum()
    if algo.loss_algo == "gspo-token":
        seq = (np.clip(l - b, -20, 20) * mask).sum(1) / np.maximum(mask.sum(1), 1.0)
        ratio, w = np.exp(np.minimum(np.broadcast_to(seq[:, None], l.shape), 10.0)), np.ones_like(l)
    else:
        ratio, w = np.exp(np.clip(l - o, -20, 20)), np.minimum(np.exp(np.clip(o - b, -20, 20)), algo.tis_cap)
    unclipped, clipped = -a * ratio, -a * np.clip(ratio, 1 - algo.eps_low, 1 + algo.eps_high)
    per_token = np.maximum(unclipped, clipped) * w
    grad = np.where(clipped > unclipped, 0.0, -a * ratio) * w * mask / n
    return (per_token * mask).sum() / n, grad, k


def logprobs_of(model, batch):
    """The padded rows' log-probs under `model` as a compiled function of its params (eager, the forward and its
    vector-Jacobian product run op by op: minutes on a loaded machine)."""
    return jax.jit(lambda params: sequence_logprobs(model, params, batch.tokens, batch.valid, 1.0, 0))


CASES = [("packed", "random", "grpo", False), ("one-a-row", "random", "gspo-token", True),
         ("packed", "multi-turn", "gspo-token", False), ("one-a-row", "multi-turn", "grpo", True)]


@pytest.mark.parametrize("rows,kind,loss_algo,lora", CASES)
def test_signal_and_gradient_equal_a_numpy_reference(rows, kind, loss_algo, lora):
    algo, teacher = ALGOS[loss_algo], teacher_model()
    model, params, trainable = student(lora)
    batch = batch_of(kind, algo)
    n = batch.tokens.shape[0]
    shape = layout(rows=3, sequences=n) if rows == "packed" else one_a_row(rows=3, sequences=n)
    updater = PolicyUpdater(model, params, algo, 1e-2, 1.0, 1.0, 0, shape, trainable=trainable, teacher=teacher,
                            distill=DISTILL)
    old_params = noisy(params, 1, 0.05)  # the proximal policy differs from the trained one: ratios off 1, clipping
    rows = logprobs_of(model, batch)  # one program for l, o and the reference's vector-Jacobian product
    l, o = np.asarray(rows(params), np.float64), np.asarray(rows(old_params), np.float64)
    t = np.asarray(logprobs_of(teacher.model, batch)(teacher.model.params), np.float64)
    mask = np.asarray(batch.loss_mask, np.float64)
    if kind == "multi-turn":  # observation tokens are in the sequences but out of the mask: nothing distilled there
        assert ((mask == 0) & np.asarray(batch.valid[:, 1:]) & (np.arange(mask.shape[1]) >= PROMPT - 1)).any()
    loss, dl, k = numpy_reference(l, o, t, np.asarray(batch.behaviour_logprobs, np.float64), mask,
                                  np.asarray(batch.advantages, np.float64), algo, DISTILL)
    train, frozen = updater.split(params)
    g_ref = jax.jit(lambda tr, ct: jax.vjp(lambda x: rows(updater.join(x, frozen)), tr)[1](ct)[0])(
        train, jnp.asarray(dl, jnp.float32))
    g_upd, metrics = updater.minibatch_gradients(batch, old_params)
    gap = optax.global_norm(jax.tree.map(lambda a, b: a - b, g_upd, g_ref)) / optax.global_norm(g_ref)
    assert float(optax.global_norm(g_ref)) > 0 and float(gap) < 1e-4, float(gap)
    assert float(metrics["pg_loss"]) == pytest.approx(loss, rel=1e-4, abs=1e-6)
    assert float(metrics["distill_kl"]) == pytest.approx((k * mask).sum() / mask.sum(), rel=1e-4, abs=1e-6)
    assert float(metrics["distill_teacher_logprob"]) == pytest.approx((t * mask).sum() / mask.sum(), rel=1e-4)


def test_distillation_alone_needs_no_reward_and_reports_kl_quantiles():
    """reward_weight 0 and every reward advantage 0: the teacher alone drives the update; the step reports the KL's
    mean and quantiles over the loss's tokens at the step's start, and the teacher's mean log-prob."""
    model, params, _ = student(False)
    batch = random_batch(5, n=12)
    batch = batch.replace(advantages=np.zeros_like(batch.advantages))
    alone = DistillSection(teacher="teacher-dir", kl_coef=1.0, reward_weight=0.0)
    teacher = teacher_model()
    updater = PolicyUpdater(model, params, ALGOS["grpo"], 1e-2, 1.0, 1.0, 0, layout(rows=3, sequences=12),
                            teacher=teacher, distill=alone)
    l = np.asarray(logprobs_of(model, batch)(params))
    t = np.asarray(logprobs_of(teacher.model, batch)(teacher.model.params))
    mask = batch.loss_mask > 0
    out = updater.update(batch)
    assert out["grad_norm"] > 0
    k = (l - t)[mask]
    assert out["distill_kl"] == pytest.approx(k.mean(), rel=1e-4)
    assert out["distill_teacher_logprob"] == pytest.approx(t[mask].mean(), rel=1e-4)
    for q in (50, 90, 99):
        assert out[f"distill_kl_p{q}"] == pytest.approx(np.quantile(k, q / 100), rel=1e-4, abs=1e-5)
    # and without the teacher the same zero advantages train nothing
    plain = PolicyUpdater(model, params, ALGOS["grpo"], 1e-2, 1.0, 1.0, 0, layout(rows=3, sequences=12))
    assert plain.update(batch)["grad_norm"] == 0.0


def test_a_teacher_without_the_section_or_the_reverse_is_refused():
    model, params, _ = student(False)
    with pytest.raises(ValueError, match="both the teacher model and the distill section"):
        PolicyUpdater(model, params, ALGOS["grpo"], 1e-2, 1.0, 1.0, 0, layout(), teacher=teacher_model())
    with pytest.raises(ValueError, match="both the teacher model and the distill section"):
        PolicyUpdater(model, params, ALGOS["grpo"], 1e-2, 1.0, 1.0, 0, layout(), distill=DISTILL)
