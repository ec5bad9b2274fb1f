"""bfloat16 parameters trained through a float32 master copy (trainer.optimizer.state_dtype=float32), against
bfloat16 optimizer state ('params'): small updates accumulate in the copy instead of rounding away."""

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.config.learning import OptimizerSection
from grpo_stream.trainer_service.learning.train_step import (MasterWeights, apply_optimizer, init_optimizer_state,
                                                   make_optimizer, uses_master_weights)


def run(params, state_dtype: str, steps: int, lr: float = 1e-4):
    opt_cfg = OptimizerSection(name="adamw", weight_decay=0.0, state_dtype=state_dtype)
    optimizer = make_optimizer(lr, 1.0, opt_cfg)
    master = uses_master_weights(params, state_dtype)
    state = init_optimizer_state(optimizer, params, master)
    step = jax.jit(lambda p, s, g: apply_optimizer(optimizer, g, s, p, master))
    grads = jax.tree.map(lambda p: jnp.full(p.shape, -1.0, p.dtype), params)  # every weight climbs at lr per step
    for _ in range(steps):
        params, state = step(params, state, grads)
    return params, state


def test_float32_parameters_need_no_master_copy():
    params = {"w": jnp.ones((4, 4), jnp.float32)}
    assert not uses_master_weights(params, "float32")
    _, state = run(params, "float32", 1)
    assert not isinstance(state, MasterWeights)


def test_small_updates_accumulate_in_the_master_copy_and_round_away_without_it():
    # a weight of 1.0 in bfloat16 moves only in steps of 2**-7; an update of 1e-4 (Adam's step at lr 1e-4) rounds
    # away every time unless something keeps the sum of updates in float32
    params = {"w": jnp.ones((8,), jnp.bfloat16)}
    kept, state = run(params, "float32", 200)
    assert isinstance(state, MasterWeights)
    assert state.params["w"].dtype == jnp.float32 and kept["w"].dtype == jnp.bfloat16
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.inner) if x.ndim)  # the moments
    np.testing.assert_allclose(np.asarray(state.params["w"]), 1.0 + 200 * 1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(kept["w"], np.float32), 1.02, atol=2 ** -7)  # the copy, rounded
    lost, state = run(params, "params", 200)
    assert not isinstance(state, MasterWeights)
    np.testing.assert_array_equal(np.asarray(lost["w"], np.float32), 1.0)  # every update rounded away
