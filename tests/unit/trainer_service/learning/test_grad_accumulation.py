"""trainer.micro_batch_size (with trainer.packing=false: sequences per pass, each alone in its row): summing the
gradients of a minibatch's passes gives the update of one plain pass over the whole minibatch, for every aggregation
(whose denominators are the minibatch's), with the same metrics; a minibatch that does not fill its last pass
(injected groups of another size) leaves empty rows that count for nothing; a micro-batch size that does not divide
the configured minibatch is refused, naming the field."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_stream.common.config.base import ConfigError
from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.model.policy import sequence_logprobs
from grpo_stream.trainer_service.learning.batching import TrainBatch, build_batch
from grpo_stream.trainer_service.learning.packing import one_sequence_per_row, pack_batch
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater
from tests.unit.trainer_service.learning.packing_cases import reference_gradients
from tests.unit.trainer_service.learning.test_rl_update import rollout  # noqa: F401  (module fixture: real engine groups)

REL = 1e-5


def updater_and_batch(tiny_parts, groups, micro, **algo):
    """An updater of passes of `micro` sequences, one a row (None: the whole minibatch in one pass), and the
    groups' batch."""
    cfg, _, tok, model = tiny_parts
    gen = cfg.generation
    a = AlgoSection(tis_cap=2.0, **algo)
    batch, _ = build_batch(groups, gen.max_prompt_tokens, gen.max_new_tokens, tok.pad_id, a, held_version=0)
    # behaviour logprobs off the trainer's (a stale sampler) so the importance weights are not all 1
    batch = batch.replace(behaviour_logprobs=batch.behaviour_logprobs - 0.05 * batch.loss_mask)
    sequences = batch.tokens.shape[0] // a.minibatches
    layout = one_sequence_per_row(gen.max_prompt_tokens, gen.max_prompt_tokens + gen.max_new_tokens,
                                  micro or sequences, sequences)
    updater = PolicyUpdater(model, model.params, a, 1e-2, 1.0, gen.temperature, tok.pad_id, layout)
    return updater, batch


def gradients(tiny_parts, groups, micro, **algo):
    """The minibatch's gradients and metrics, summed over passes of `micro` sequences (None: the plain reference,
    every padded row in one pass)."""
    updater, batch = updater_and_batch(tiny_parts, groups, micro, **algo)
    grads, metrics = (reference_gradients(updater, batch) if micro is None else updater.minibatch_gradients(batch))
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
    """One sequence a row (trainer.packing=false; packed rows' exactness is test_packed_update.py's), in passes of 4
    and of 2 sequences, against one plain pass: the default lane takes token-mean, -m heavy the other
    aggregations."""
    whole = gradients(tiny_parts, rollout, None, loss_agg_mode=agg)
    assert_same(gradients(tiny_parts, rollout, 4, loss_agg_mode=agg), whole)
    assert_same(gradients(tiny_parts, rollout, 2, loss_agg_mode=agg), whole)


@pytest.mark.heavy  # whole updates of the one-a-row passes; packed whole updates are default-lane
def test_an_update_of_several_minibatches_with_gspo_matches_too(tiny_parts, rollout):  # noqa: F811
    """Whole updates (two passes of two minibatches, GSPO's ratio off 1 after the first), in passes of 2 sequences
    and of the whole minibatch: the same metrics, and parameters within Adam's sensitivity (a first Adam step
    divides each gradient by its own size)."""
    algo = dict(loss_algo="gspo-token", minibatches=2, num_iterations=2)
    runs = []
    for micro in (2, None):
        updater, batch = updater_and_batch(tiny_parts, rollout, micro, **algo)
        runs.append((updater.update(batch), updater.params))
    (m_acc, p_acc), (m_one, p_one) = runs
    assert m_acc.keys() == m_one.keys() and m_acc["optimizer_steps"] == 4
    for key in m_one:
        if key.startswith("update_tokens"):  # passes of 2 rows leave fewer empty rows than one of the minibatch
            continue
        assert m_acc[key] == pytest.approx(m_one[key], rel=1e-4, abs=1e-6), key
    for x, y in zip(jax.tree.leaves(p_acc), jax.tree.leaves(p_one)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


@pytest.mark.heavy  # one-a-row passes; the packed passes' empty rows are default-lane (test_packed_update.py)
def test_an_uneven_minibatch_leaves_empty_rows_that_count_for_nothing(tiny_parts, rollout):  # noqa: F811
    groups = rollout[:3]  # 3 groups of 4 rows: 12 sequences, passes of 8 leave 4 rows of the second empty
    assert_same(gradients(tiny_parts, groups, 8), gradients(tiny_parts, groups, None))


def test_bfloat16_weights_sum_their_passes_gradients_in_float32(tiny_parts, rollout):  # noqa: F811
    """bfloat16 weights trained through a float32 master copy: three passes of one same sequence sum to exactly three
    times one pass's gradient. Summed in bfloat16, the third pass rounded the sum to 8 bits of mantissa (a minibatch
    of many passes lost the small gradients of its later ones)."""
    cfg, _, tok, model = tiny_parts
    gen = cfg.generation
    bf16 = dataclasses.replace(model, params=jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, model.params))
    batch, _ = build_batch(rollout, gen.max_prompt_tokens, gen.max_new_tokens, tok.pad_id, AlgoSection(),
                           held_version=0)
    batch = jax.tree.map(lambda x: np.repeat(x[:1], 3, axis=0), batch).replace(advantages=np.ones(3, np.float32))
    layout = one_sequence_per_row(gen.max_prompt_tokens, gen.max_prompt_tokens + gen.max_new_tokens, 1, 3)
    updater = PolicyUpdater(bf16, bf16.params, AlgoSection(), 1e-2, 1.0, gen.temperature, tok.pad_id, layout)
    assert updater.master
    (passes, _, norm), = updater.programs.place(pack_batch(batch, layout, 1, tok.pad_id))
    summed = [updater.programs.gradients(*updater.split(updater.params), passes, jnp.int32(count), None, None, None,
                                         norm)[0] for count in (1, 3)]
    one, three = (jax.tree.leaves(g) for g in summed)
    assert any(np.any(np.asarray(g, np.float32)) for g in one)
    for a, b in zip(one, three):
        np.testing.assert_array_equal(np.asarray(b, np.float32), 3 * np.asarray(a, np.float32))


def test_a_micro_batch_size_that_does_not_divide_the_minibatch_is_refused():
    """Without packing (packed passes are rows, not sequences, and need not divide anything)."""
    with pytest.raises(ConfigError, match="trainer.micro_batch_size=3 must divide the 64 sequences of a minibatch"):
        load_config(None, ["trainer.groups_per_step=16", "generation.num_generations=8", "algo.minibatches=2",
                           "trainer.micro_batch_size=3", "trainer.packing=false"])
    load_config(None, ["trainer.groups_per_step=16", "generation.num_generations=8", "algo.minibatches=2",
                       "trainer.micro_batch_size=3"])


def test_old_and_reference_logprobs_pass_by_pass_equal_one_plain_pass(tiny_parts):
    """The logprobs of a whole step's batch under fixed weights (old policy, KL reference), computed pass by pass
    over rows of one sequence (3 rows a pass), equal one plain pass over the padded rows at every completion
    position."""
    cfg, _, tok, model = tiny_parts
    gen = cfg.generation
    rng = np.random.default_rng(1)
    rows, p, length = 12, gen.max_prompt_tokens, gen.max_prompt_tokens + gen.max_new_tokens
    tokens = rng.integers(1, tok.vocab_size, (rows, length)).astype(np.int32)
    valid = np.ones((rows, length), bool)
    mask = np.zeros((rows, length - 1), np.float32)
    mask[:, p - 1:] = 1.0
    batch = TrainBatch(tokens=tokens, valid=valid, loss_mask=mask, behaviour_logprobs=np.zeros_like(mask),
                       advantages=np.zeros(rows, np.float32), fresh=np.zeros(rows, np.float32))
    updater = PolicyUpdater(model, model.params, AlgoSection(beta=0.1), 1e-3, 1.0, 1.0, tok.pad_id,
                            one_sequence_per_row(p, length, 3, rows))
    packed = pack_batch(batch, updater.layout, 1, tok.pad_id)
    (passes, count, _), = updater.programs.place(packed)
    assert int(count) == 4
    rows_lp = np.asarray(updater.programs.logprobs(model.params, passes, count))  # [passes, 3, T - 1]
    got = np.zeros_like(mask)
    packed.scatter(0, rows_lp, got)  # each sequence's completion positions back at its own row
    whole = np.asarray(sequence_logprobs(model, model.params, jnp.asarray(tokens), jnp.asarray(valid), 1.0,
                                         tok.pad_id))
    np.testing.assert_allclose(got[:, p - 1:], whole[:, p - 1:], rtol=1e-6, atol=1e-6)


MESH_SCRIPT = """
import jax, numpy as np, optax
from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.model.policy import build_model
from grpo_stream.common.model.sharding import make_mesh, place
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.learning.packing import one_sequence_per_row
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater

cfg = load_config('configs/tiny_arith.yaml', [])
model = build_model(cfg.model, cfg.model.tiny.vocab_size, seed=0)
mesh = make_mesh(2, 2, jax.devices(), 'trainer.mesh')
rng = np.random.default_rng(0)
rows, length = 8, 24
batch = TrainBatch(tokens=rng.integers(1, 150, (rows, length)).astype(np.int32), valid=np.ones((rows, length), bool),
                   loss_mask=np.ones((rows, length - 1), np.float32),
                   behaviour_logprobs=np.full((rows, length - 1), -4.0, np.float32),
                   advantages=rng.normal(size=rows).astype(np.float32), fresh=np.zeros(rows, np.float32))
grads = {}
for micro in (4, 2):  # a minibatch of 4 sequences in one pass, or in two of one sequence per fsdp device
    params = place(model.params, mesh)
    shardings = [x.sharding for x in jax.tree.leaves(params)]
    updater = PolicyUpdater(model, params, AlgoSection(beta=0.1, minibatches=2), 1e-2, 1.0, 1.0, 0,
                            one_sequence_per_row(1, length, micro, rows // 2), mesh, donate=True)
    half = jax.tree.map(lambda x: x[:rows // 2], batch)
    g, _ = updater.minibatch_gradients(half, None, updater.ref_params)
    for x, s in zip(jax.tree.leaves(g), shardings):  # gradients are laid out as the parameters
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
    grads[micro] = jax.tree.map(np.asarray, g)
    updater.update(batch)  # two minibatches, in passes, donating: the update keeps the layout
    updater.update(batch)
    for x, s in zip(jax.tree.leaves(updater.params), shardings):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.shape, x.sharding, s)
diff = optax.global_norm(jax.tree.map(lambda a, b: a - b, grads[4], grads[2]))
assert float(diff) <= 1e-5 * float(optax.global_norm(grads[4])), float(diff)
print('ok')
"""


@pytest.mark.heavy  # 4 fake devices; the one-a-row passes' exactness on one device is default-lane
def test_micro_batches_on_a_four_device_mesh_give_the_update_of_one_pass(tmp_path):
    """fsdp=2 x tp=2 on fake CPU devices, one sequence a row: gradients summed over passes of 2 rows (one per fsdp
    device) equal one pass's to 1e-5 of their norm and are laid out as the parameters; updates (a KL reference,
    two minibatches, donation) keep the parameters' layout."""
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
