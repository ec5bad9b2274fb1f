"""trainer.micro_batch_size: summing the gradients of micro-batches gives the same optimizer update as one pass
over the minibatch, for every aggregation (whose denominators are the minibatch's), with the same metrics; a
minibatch that does not split evenly (injected groups of another size) is filled with rows that count for
nothing; a micro-batch size that does not divide the configured minibatch is refused, naming the field."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.learning.batching import build_batch
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater, _fill_micro_batches
# the module fixture (real engine groups)
from tests.unit.trainer_service.learning.test_rl_update import rollout  # noqa: F401

REL = 1e-5


def updater_and_batch(tiny_parts, groups, micro, **algo):
    cfg, _, tok, model = tiny_parts
    a = AlgoSection(tis_cap=2.0, **algo)
    batch, _ = build_batch(groups, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens, tok.pad_id, a,
                           held_version=0)
    # behaviour logprobs off the trainer's (a stale sampler) so the importance weights are not all 1
    batch = batch.replace(behaviour_logprobs=batch.behaviour_logprobs - 0.05 * batch.loss_mask)
    updater = PolicyUpdater(model, model.params, a, 1e-2, 1.0, cfg.generation.temperature, tok.pad_id,
                            micro_batch_size=micro)
    return updater, batch


def gradients(tiny_parts, groups, micro, **algo):
    """The minibatch's gradients and metrics, in one pass or summed over micro-batches."""
    updater, batch = updater_and_batch(tiny_parts, groups, micro, **algo)
    batch, _, _ = _fill_micro_batches(batch, None, None, micro)
    grads, metrics = jax.jit(updater.gradients)(*updater.split(updater.params), batch)
    return grads, {k: float(v) for k, v in metrics.items()}


def assert_same(a, b):
    """Gradients equal to 1e-5 of their global norm, every metric to 1e-5 relative."""
    (ga, ma), (gb, mb) = a, b
    diff = optax.global_norm(jax.tree.map(lambda x, y: x - y, ga, gb))
    assert float(diff) <= REL * float(optax.global_norm(gb)), (float(diff), float(optax.global_norm(gb)))
    assert ma.keys() == mb.keys()
    for key in ma:
        assert ma[key] == pytest.approx(mb[key], rel=REL, abs=1e-7), key


@pytest.mark.parametrize("agg", ["token-mean", pytest.param("sequence-mean-token-mean", marks=pytest.mark.heavy),
                                 pytest.param("sequence-mean-token-sum-norm", marks=pytest.mark.heavy)])
def test_micro_batches_give_the_update_of_one_pass(tiny_parts, rollout, agg):  # noqa: F811
    """The padded layout's micro-batches (trainer.packing=false; the packed passes' exactness is
    test_packed_update.py's): the default lane takes token-mean, -m heavy the other aggregations."""
    whole = gradients(tiny_parts, rollout, None, loss_agg_mode=agg)
    assert_same(gradients(tiny_parts, rollout, 4, loss_agg_mode=agg), whole)
    assert_same(gradients(tiny_parts, rollout, 2, loss_agg_mode=agg), whole)


@pytest.mark.heavy  # the padded layout's (trainer.packing=false); the packed passes' are default-lane
def test_an_update_of_several_minibatches_with_gspo_matches_too(tiny_parts, rollout):  # noqa: F811
    """Whole updates (two passes of two minibatches, GSPO's ratio off 1 after the first): the same metrics, and
    parameters within Adam's sensitivity (a first Adam step divides each gradient by its own size)."""
    algo = dict(loss_algo="gspo-token", minibatches=2, num_iterations=2)
    runs = []
    for micro in (2, None):
        updater, batch = updater_and_batch(tiny_parts, rollout, micro, **algo)
        runs.append((updater.update(batch), updater.params))
    (m_acc, p_acc), (m_one, p_one) = runs
    assert m_acc.keys() == m_one.keys() and m_acc["optimizer_steps"] == 4
    for key in m_one:
        assert m_acc[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
    for x, y in zip(jax.tree.leaves(p_acc), jax.tree.leaves(p_one)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


@pytest.mark.heavy  # the padded layout's (trainer.packing=false); the packed passes' are default-lane
def test_an_uneven_minibatch_is_filled_with_rows_that_count_for_nothing(tiny_parts, rollout):  # noqa: F811
    groups = rollout[:3]  # 3 groups of 4 rows: 12 rows, micro-batches of 8 need 4 more
    assert_same(gradients(tiny_parts, groups, 8), gradients(tiny_parts, groups, None))


def test_a_micro_batch_size_that_does_not_divide_the_minibatch_is_refused():
    """Without packing (packed passes are rows, not sequences, and need not divide anything)."""
    with pytest.raises(ConfigError, match="trainer.micro_batch_size=3 must divide the 64 sequences of a minibatch"):
        load_config(None, ["trainer.groups_per_step=16", "generation.num_generations=8", "algo.minibatches=2",
                           "trainer.micro_batch_size=3", "trainer.packing=false"])
    load_config(None, ["trainer.groups_per_step=16", "generation.num_generations=8", "algo.minibatches=2",
                       "trainer.micro_batch_size=3"])


def test_old_and_reference_logprobs_in_micro_batches_equal_one_pass(tiny_parts):
    """The logprobs of a whole step's batch (old policy, KL reference) computed in passes of micro_batch_size rows
    (strided, as the micro-batches are) come back in row order, equal to one pass."""
    cfg, _, tok, model = tiny_parts
    rng = np.random.default_rng(1)
    rows, length = 12, cfg.generation.max_prompt_tokens + cfg.generation.max_new_tokens
    tokens = jnp.asarray(rng.integers(1, tok.vocab_size, (rows, length)), jnp.int32)
    valid = jnp.ones((rows, length), bool)
    whole = PolicyUpdater(model, model.params, AlgoSection(beta=0.1), 1e-3, 1.0, 1.0, tok.pad_id)
    parts = PolicyUpdater(model, model.params, AlgoSection(beta=0.1), 1e-3, 1.0, 1.0, tok.pad_id, micro_batch_size=3)
    np.testing.assert_allclose(np.asarray(parts.logprobs(model.params, tokens, valid)),
                               np.asarray(whole.logprobs(model.params, tokens, valid)), rtol=1e-6, atol=1e-6)


MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, optax
from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.model.policy import build_model
from grpo_stream.common.model.sharding import make_mesh, place, rows_sharding
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater

cfg = load_config('configs/tiny_arith.yaml', [])
model = build_model(cfg.model, cfg.model.tiny.vocab_size, seed=0)
mesh = make_mesh(2, 2, jax.devices(), 'trainer.mesh')
rng = np.random.default_rng(0)
rows, length = 8, 24
batch = TrainBatch(tokens=jnp.asarray(rng.integers(1, 150, (rows, length)), jnp.int32),
                   valid=jnp.ones((rows, length), bool), loss_mask=jnp.ones((rows, length - 1)),
                   behaviour_logprobs=jnp.full((rows, length - 1), -4.0), advantages=jnp.asarray(rng.normal(size=rows)),
                   fresh=jnp.zeros(rows))
batch = jax.device_put(batch, rows_sharding(mesh, rows))
grads = {}
for micro in (None, 2):
    params = place(model.params, mesh)
    shardings = [x.sharding for x in jax.tree.leaves(params)]
    updater = PolicyUpdater(model, params, AlgoSection(beta=0.1, minibatches=2), 1e-2, 1.0, 1.0, 0, mesh,
                            micro_batch_size=micro, donate=True)
    ref = updater.logprobs(updater.ref_params, batch.tokens, batch.valid)
    g, _ = jax.jit(updater.gradients)(*updater.split(updater.params), batch, None, ref)
    for x, s in zip(jax.tree.leaves(g), shardings):  # gradients are laid out as the parameters
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
    grads[micro] = jax.tree.map(np.asarray, g)
    updater.update(batch)  # two minibatches, micro-batched, donating: the update keeps the layout
    updater.update(batch)
    for x, s in zip(jax.tree.leaves(updater.params), shardings):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
diff = optax.global_norm(jax.tree.map(lambda a, b: a - b, grads[None], grads[2]))
assert float(diff) <= 1e-5 * float(optax.global_norm(grads[None])), float(diff)
print('ok')
"""


@pytest.mark.heavy  # the padded layout's (trainer.packing=false); the packed passes' are default-lane
def test_micro_batches_on_a_four_device_mesh_give_the_update_of_one_pass(tmp_path):
    """fsdp=2 x tp=2 on fake CPU devices: gradients summed over micro-batches of 2 rows (one per fsdp device) equal
    one pass's to 1e-5 of their norm and are laid out as the parameters; updates (a KL reference, two minibatches,
    donation) keep the parameters' layout."""
    import os
    import pathlib
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
           "--xla_cpu_collective_call_terminate_timeout_seconds=240"}
    root = pathlib.Path(__file__).resolve().parents[4]
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
