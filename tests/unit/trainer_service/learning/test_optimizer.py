"""trainer.optimizer: Adam or AdamW after the gradient clip, and the learning-rate schedules (warmup then constant
or cosine), counted in trainer steps of however many optimizer updates; the trainer's metrics report the rate, and
a restored optimizer state continues the schedule where it stopped."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from pydantic import ValidationError

from grpo_stream.common.config.learning import AlgoSection, OptimizerSection
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.learning.batching import build_batch
from grpo_stream.trainer_service.learning.packing import packing_layout
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater
from grpo_stream.trainer_service.learning.train_step import learning_rate_schedule, make_optimizer
from tests.unit.trainer_service.learning.test_rl_update import rollout  # noqa: F401  (module fixture: real engine groups)

LR = 1e-2


def test_warmup_then_constant_counts_trainer_steps_of_several_updates():
    rate = learning_rate_schedule(LR, OptimizerSection(schedule="warmup_constant", warmup_steps=4), total_steps=10,
                                  updates_per_step=2)
    assert [round(float(rate(u)), 6) for u in (0, 4, 8, 9, 100)] == [0.0, LR / 2, LR, LR, LR]


def test_warmup_cosine_reaches_the_end_factor_at_decay_steps_or_the_run_end():
    opt = OptimizerSection(schedule="warmup_cosine", warmup_steps=2, end_lr_factor=0.1)
    rate = learning_rate_schedule(LR, opt, total_steps=10)
    assert float(rate(2)) == pytest.approx(LR)
    assert float(rate(6)) == pytest.approx(LR * (0.1 + 0.9 * 0.5))  # half-way through the cosine
    assert float(rate(10)) == pytest.approx(LR * 0.1) and float(rate(50)) == pytest.approx(LR * 0.1)
    short = learning_rate_schedule(LR, opt.model_copy(update={"decay_steps": 4}), total_steps=10)
    assert float(short(4)) == pytest.approx(LR * 0.1)


def test_constant_adam_keeps_the_optimizer_state_layout_of_checkpoints_made_before_the_option():
    params = {"w": jnp.ones(3)}
    legacy = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(LR))
    assert (jax.tree.structure(make_optimizer(LR, 1.0, OptimizerSection()).init(params))
            == jax.tree.structure(legacy.init(params)))


def test_adamw_decays_every_parameter_by_rate_times_decay():
    params = {"w": jnp.array([1.0, -2.0, 4.0])}
    opt = make_optimizer(LR, 1.0, OptimizerSection(name="adamw", weight_decay=0.1))
    updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["w"], params["w"] * (1 - LR * 0.1), rtol=1e-6)  # zero gradient: decay alone


@pytest.mark.parametrize("fields, message", [
    ({"weight_decay": 0.1}, "trainer.optimizer.weight_decay"),
    ({"warmup_steps": 5}, "trainer.optimizer.warmup_steps"),
    ({"schedule": "warmup_cosine", "warmup_steps": 5, "decay_steps": 5}, "trainer.optimizer.decay_steps"),
])
def test_inconsistent_settings_name_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        OptimizerSection(**fields)


def test_a_warmup_as_long_as_the_run_is_refused(small_cfg):
    with pytest.raises(Exception, match="trainer.optimizer.warmup_steps=400"):
        load_config(None, ["trainer.steps=400", "trainer.optimizer.schedule=warmup_cosine",
                           "trainer.optimizer.warmup_steps=400"])


def test_the_update_reports_its_rate_and_a_restored_state_continues_the_schedule(tiny_parts, rollout):  # noqa: F811
    cfg, _, tok, model = tiny_parts
    algo = AlgoSection(minibatches=2)
    batch, _ = build_batch(rollout, cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens, tok.pad_id,
                           algo, held_version=0)
    opt = OptimizerSection(name="adamw", weight_decay=0.01, schedule="warmup_cosine", warmup_steps=2)

    def updater(params):
        return PolicyUpdater(model, params, algo, LR, 1.0, cfg.generation.temperature, tok.pad_id,
                             packing_layout(cfg, 1), optimizer=opt, total_steps=6)

    first = updater(model.params)
    rates = [first.update(batch)["learning_rate"] for _ in range(3)]
    # two updates per step: after steps 1, 2, 3 the next update is number 2, 4, 6 of a 4-update warmup
    assert rates == pytest.approx([LR / 2, LR, LR * 0.5 * (1 + np.cos(np.pi * 2 / 8))], rel=1e-5)
    resumed = updater(first.params)
    resumed.opt_state = first.opt_state  # what a checkpoint restores
    assert resumed.update(batch)["learning_rate"] == pytest.approx(float(first.learning_rate(8)), rel=1e-5)
