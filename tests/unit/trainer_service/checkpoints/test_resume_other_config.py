"""A run resumed under settings that change what its checkpoint holds is refused naming the settings that changed and
their saved values: the error used to list shapes, dtypes, model.lora and algo.beta as the possible causes, none of
which had changed when the cause was trainer.optimizer (a schedule adds a step count to the optimizer state,
state_dtype=float32 a float32 copy of bfloat16 parameters)."""

import re
from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.checkpoints.durability import Durability
from grpo_stream.trainer_service.checkpoints.errors import CheckpointMismatch
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints
from grpo_stream.trainer_service.learning.train_step import init_optimizer_state, make_optimizer, uses_master_weights

RUN = ["run.name=r1", "model.dtype=bfloat16"]


class Buffer:
    """What saving and resuming ask of the buffer."""

    def check_fence(self):
        pass

    def settle(self, outcomes):
        return len(list(outcomes))


def updater(cfg):
    """An updater's state as the books see it, its optimizer state made from `cfg` as the trainer's is."""
    params = {"w": jnp.ones((4, 8), jnp.bfloat16)}
    opt = cfg.trainer.optimizer
    state = init_optimizer_state(make_optimizer(cfg.trainer.learning_rate, cfg.trainer.max_grad_norm, opt, 10),
                                 params, uses_master_weights(params, opt.state_dtype))
    return SimpleNamespace(params=params, opt_state=state, ref_params=None, split=lambda p: (p, None))


def books(tmp_path, cfg) -> Durability:
    return Durability(cfg, Buffer(), TrainerCheckpoints(str(tmp_path), keep=3, verify=True), "e1")


@pytest.mark.parametrize("override, saved, now", [
    ("trainer.optimizer.schedule=warmup_cosine", '"constant"', '"warmup_cosine"'),
    ("trainer.optimizer.state_dtype=params", '"float32"', '"params"'),
])
def test_a_resume_under_another_optimizer_layout_names_the_setting_and_its_saved_value(tmp_path, override, saved,
                                                                                       now):
    cfg = load_config(None, RUN)
    first = books(tmp_path, cfg)
    first.save(2, updater(cfg), {})
    first.checkpoints.close()
    changed = load_config(None, [*RUN, override])
    field = override.split("=")[0]
    with pytest.raises(CheckpointMismatch, match=re.escape(
            f"{field} was {saved} when it was saved, {now} in this config. Set {field}={saved} to resume it")) as err:
        books(tmp_path, changed).resume(updater(changed))
    assert "algo.beta" not in str(err.value) and "model." not in str(err.value)  # only what changed
    assert (tmp_path / "2").is_dir()  # kept: the run's own settings resume it
    assert books(tmp_path, cfg).resume(updater(cfg)).step == 2


def test_a_checkpoint_saved_without_its_settings_lists_the_optimizer_among_the_causes(tmp_path):
    cfg = load_config(None, RUN)
    store = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    first = updater(cfg)
    store.save(2, {"params": first.params, "opt_state": first.opt_state}, {"run": "r1", "unsettled": []})
    store.close()
    changed = load_config(None, [*RUN, "trainer.optimizer.schedule=warmup_constant"])
    with pytest.raises(CheckpointMismatch, match=r"holds a different model or optimizer state \(.*"
                                                 r"trainer.optimizer.schedule constant or not; "
                                                 r"trainer.optimizer.state_dtype\)"):
        books(tmp_path, changed).resume(updater(changed))
