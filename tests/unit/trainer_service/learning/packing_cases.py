"""The update against a plain reference: a minibatch's gradients and statistics through the update's packed rows (and
its one-sequence-a-row case, trainer.packing=false) against the objective computed on every sequence in its own
padded row (common/model/policy.sequence_logprobs, the whole minibatch at once), on random long-tailed batches.
Imported by test_packed_update.py, and run as a script in a subprocess on a 4-device fake CPU mesh:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m tests.unit.trainer_service.learning.packing_cases 0 3
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_stream.common.config.learning import AlgoSection, LoraSection, ModelSection, TinyModelSection
from grpo_stream.common.model.lora import apply_lora
from grpo_stream.common.model.policy import build_model, sequence_logprobs
from grpo_stream.common.model.sharding import make_mesh, place
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.learning.packed_update import LOG_RATIO
from grpo_stream.trainer_service.learning.packing import PackingLayout, one_sequence_per_row, segments_per_row
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater

VOCAB, PROMPT, COMPLETION, SEQUENCES = 96, 10, 24, 24
AGGS = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-sum-norm")
# every combination of (aggregation, loss, beta, TIS cap, LoRA); PAIRWISE covers each pair of values of any two
ALL = list(itertools.product(AGGS, ("grpo", "gspo-token"), (0.0, 0.1), (2.0, None), (False, True)))
PAIRWISE = [("token-mean", "grpo", 0.0, 2.0, False), ("token-mean", "gspo-token", 0.1, None, True),
            ("sequence-mean-token-mean", "grpo", 0.1, None, False),
            ("sequence-mean-token-mean", "gspo-token", 0.0, 2.0, True),
            ("sequence-mean-token-sum-norm", "grpo", 0.1, 2.0, True),
            ("sequence-mean-token-sum-norm", "gspo-token", 0.0, None, False)]


def random_weights_model(tiny: TinyModelSection, seed: int, scale: float):
    """A tiny model with every weight random, N(0, scale) (Tunix starts the MLP at zero, where its gradients vanish)."""
    model = build_model(ModelSection(tiny=tiny), VOCAB, seed=seed)
    rng = np.random.default_rng(seed)
    named = {k: jnp.asarray(rng.normal(0, scale, v.shape).astype(np.float32)) if k.endswith("kernel") or not np.any(v)
             else v for k, v in model.to_named_numpy().items()}
    return dataclasses.replace(model, params=model.from_named_numpy(named))


@functools.cache
def random_model():
    """A one-layer tiny model with every weight random."""
    return random_weights_model(TinyModelSection(vocab_size=VOCAB, num_layers=1, embed_dim=32, hidden_dim=64,
                                                 num_heads=2, num_kv_heads=1, head_dim=16), seed=0, scale=0.2)


def random_batch(seed: int, n: int = SEQUENCES) -> TrainBatch:
    """`n` sequences in the padded layout: prompts of 2..PROMPT tokens, completions log-normal around a quarter of
    COMPLETION with every 7th at the limit, every 11th masked out (overlong filter), some empty, mixed freshness."""
    rng = np.random.default_rng(seed)
    t = PROMPT + COMPLETION
    tokens, valid = np.zeros((n, t), np.int32), np.zeros((n, t), np.bool_)
    mask, behaviour = np.zeros((n, t - 1), np.float32), np.zeros((n, t - 1), np.float32)
    for i in range(n):
        p = int(rng.integers(2, PROMPT + 1))
        c = COMPLETION if i % 7 == 0 else 0 if i % 13 == 4 else min(COMPLETION,
                                                                     int(rng.lognormal(np.log(COMPLETION / 4), 0.8)))
        tokens[i, PROMPT - p:PROMPT + c] = rng.integers(1, VOCAB, p + c)
        valid[i, PROMPT - p:PROMPT + c] = True
        mask[i, PROMPT - 1:PROMPT - 1 + c] = 0.0 if i % 11 == 5 else 1.0
        behaviour[i, PROMPT - 1:PROMPT - 1 + c] = -rng.uniform(0.5, 6.0, c)
    return TrainBatch(tokens=tokens, valid=valid, loss_mask=mask, behaviour_logprobs=behaviour,
                      fresh=rng.integers(0, 2, n).astype(np.float32), advantages=rng.normal(size=n).astype(np.float32))


def layout(rows: int = 4, sequences: int = SEQUENCES) -> PackingLayout:
    """The packed layout of these batches: passes of `rows` rows, room for a minibatch of `sequences`."""
    return PackingLayout(PROMPT, PROMPT + COMPLETION, rows, segments_per_row(PROMPT + COMPLETION),
                         -(-sequences // rows))


def one_a_row(rows: int = 4, sequences: int = SEQUENCES) -> PackingLayout:
    """trainer.packing=false's layout of these batches: each sequence alone in its row, passes of `rows` rows."""
    return one_sequence_per_row(PROMPT, PROMPT + COMPLETION, rows, sequences)


def reference_gradients(updater: PolicyUpdater, batch: TrainBatch, old_params=None, ref_params=None):
    """(gradients of the trained part, statistics) of `batch` as one minibatch, computed plainly: every sequence in
    its own padded row, the whole minibatch in one forward and backward pass, the objective (PolicyUpdater.objective,
    whose arithmetic test_loss.py and test_gspo_off_policy.py check by hand) on the batch's own [B, T - 1] arrays.
    What the update's layout (rows, segments, passes, slot windows, normalisers) must reproduce."""
    model, t = updater.model, updater.temperature
    logprobs = lambda params: None if params is None else sequence_logprobs(  # noqa: E731
        model, params, batch.tokens, batch.valid, t, updater.pad_id)

    def loss(train, frozen):
        lp, entropy = sequence_logprobs(model, updater.join(train, frozen), batch.tokens, batch.valid, t,
                                        updater.pad_id, with_entropy=True)
        return updater.objective(lp, entropy, jnp.asarray(batch.loss_mask), jnp.asarray(batch.behaviour_logprobs),
                                 jnp.asarray(batch.advantages), jnp.asarray(batch.fresh), logprobs(old_params),
                                 logprobs(ref_params), None)

    (_, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(*updater.split(updater.params))
    metrics.pop(LOG_RATIO)
    return grads, metrics


def noisy(params, seed: int, scale: float):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def compare(case: tuple, mesh=None, seed: int = 0, packing: PackingLayout | None = None
            ) -> tuple[float, dict[str, tuple[float, float]]]:
    """(|g_update - g_reference| / |g_reference|, {metric: (reference, update)}) of one minibatch with `case`'s
    objective through the update's programs in `packing` (default: packed passes of 4 rows) against
    reference_gradients, the old policy and the KL reference other weights than the trained ones (ratios off 1,
    clipping active)."""
    agg, loss_algo, beta, tis, lora = case
    model = random_model()
    params, trainable = model.params, None
    if lora:
        adapted = apply_lora(model, model.params, LoraSection(rank=4, alpha=8.0), seed=1)
        model, trainable = adapted.adapted, adapted.trainable()
        params = noisy(adapted.adapted.params, 3, 0.05)  # B random too: adapters that change the forward pass
    place_on = (lambda tree: place(tree, mesh)) if mesh is not None else (lambda tree: tree)  # noqa: E731
    algo = AlgoSection(loss_algo=loss_algo, loss_agg_mode=agg, beta=beta, tis_cap=tis)
    updater = PolicyUpdater(model, place_on(params), algo, 1e-2, 1.0, 1.0, 0, packing or layout(rows=4), mesh,
                            trainable=trainable)
    old_params, ref_params = place_on(noisy(params, 1, 0.05)), place_on(noisy(params, 2, 0.05))
    batch = random_batch(seed)
    g_ref, m_ref = reference_gradients(updater, batch, old_params, ref_params if beta else None)
    g_upd, m_upd = updater.minibatch_gradients(batch, old_params, ref_params if beta else None)
    diff = optax.global_norm(jax.tree.map(lambda a, b: a - b, g_upd, g_ref))
    assert m_ref.keys() == m_upd.keys(), sorted(m_ref.keys() ^ m_upd.keys())
    metrics = {k: (float(m_ref[k]), float(m_upd[k])) for k in m_ref}
    return float(diff) / float(optax.global_norm(g_ref)), metrics


def worst_metric_gap(metrics: dict[str, tuple[float, float]]) -> tuple[str, float]:
    """The metric furthest apart, relative to its size (absolute below 1)."""
    gaps = {k: abs(a - b) / max(1.0, abs(a)) for k, (a, b) in metrics.items()}
    key = max(gaps, key=gaps.get)
    return key, gaps[key]


def main(indices: list[int]) -> int:
    mesh = make_mesh(len(jax.devices()), 1, jax.devices(), "trainer.mesh")
    for i in indices:
        grad_gap, metrics = compare(PAIRWISE[i], mesh)
        key, gap = worst_metric_gap(metrics)
        print(f"case {i} {PAIRWISE[i]}: gradients {grad_gap:.2e}, worst metric {key} {gap:.2e}")
        if grad_gap > 1e-5 or gap > 1e-5:
            return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main([int(x) for x in sys.argv[1:]]))
