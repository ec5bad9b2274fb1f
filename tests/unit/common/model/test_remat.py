"""trainer.remat: the update step recomputes activations in the backward pass (Tunix's attention-block or
decoder-layer remat) and gets the gradients it gets without; a family without the switch is refused, naming the
field and the alternative."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_stream.common.model.policy import remat_config, sequence_logprobs


def loss_and_grads(model, params, tokens, valid):
    fn = lambda p: sequence_logprobs(model, p, tokens, valid, 1.0, 0).sum()  # noqa: E731
    return jax.jit(jax.value_and_grad(fn))(params), jax.make_jaxpr(jax.grad(fn))(params)


@pytest.mark.parametrize("mode", ["attention", "full", "save_dots"])
def test_remat_gives_the_gradients_of_none_and_really_recomputes(tiny_parts, mode):
    _, _, _, model = tiny_parts
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, model.arch.vocab_size, (4, 24)), jnp.int32)
    valid = jnp.ones(tokens.shape, bool).at[0, :5].set(False)
    (loss, grads), plain = loss_and_grads(model, model.params, tokens, valid)
    remat = model.with_remat(mode)
    (loss_r, grads_r), recomputed = loss_and_grads(remat, model.params, tokens, valid)
    assert float(loss_r) == pytest.approx(float(loss), rel=1e-6)
    # equal up to float rounding (recomputation fuses differently): within 1e-5 of the gradient's global norm
    diff = optax.global_norm(jax.tree.map(lambda a, b: a - b, grads, grads_r))
    assert float(diff) <= 1e-5 * float(optax.global_norm(grads))
    assert "remat" not in str(plain) and "remat" in str(recomputed)  # the checkpointed blocks are in the program
    # save_dots hands its checkpoint policy to Tunix's remat; the other modes save nothing
    assert ("DotsSaveable" in str(recomputed)) == (mode == "save_dots")
    assert model.with_remat("none") is model


def test_a_family_without_a_remat_switch_is_refused(tiny_parts):
    _, _, _, model = tiny_parts
    gemma = dataclasses.replace(model.arch, family="gemma3")
    with pytest.raises(ValueError, match="trainer.remat=full: the gemma3 model has no rematerialisation switch"):
        remat_config(gemma, model.config, "full")


def test_save_dots_holds_less_than_none_and_recomputes_less_than_full(tiny_parts):
    """XLA's memory analysis of the gradient program: save_dots keeps fewer activations than no remat; full remat
    keeps fewer still, and recomputes more (more FLOPs in the compiled backward pass)."""
    _, _, _, model = tiny_parts
    tokens = jnp.ones((8, 64), jnp.int32)
    valid = jnp.ones(tokens.shape, bool)
    fn = lambda m: jax.jit(jax.grad(lambda p: sequence_logprobs(m, p, tokens, valid, 1.0, 0).sum()))  # noqa: E731
    compiled = {mode: fn(model.with_remat(mode)).lower(model.params).compile() for mode in ("none", "save_dots", "full")}
    temp = {mode: c.memory_analysis().temp_size_in_bytes for mode, c in compiled.items()}
    flops = {mode: c.cost_analysis()["flops"] for mode, c in compiled.items()}
    assert temp["full"] < temp["save_dots"] < temp["none"], temp
    assert flops["none"] < flops["save_dots"] < flops["full"], flops
