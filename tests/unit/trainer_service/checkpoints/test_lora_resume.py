"""A LoRA run resumes only under the model.lora settings its adapters were trained with: another alpha changes no
shape, so its adapters would load and silently act at another scale (W + alpha / rank A B)."""

import errno
import re

import jax.numpy as jnp
import numpy as np
import pytest
from orbax.checkpoint._src.path import atomicity

from grpo_stream.common.config.learning import LoraSection
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.checkpoints.durability import Durability
from grpo_stream.trainer_service.checkpoints.errors import CheckpointMismatch, CheckpointSaveFailed
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints


class Buffer:
    """What saving and resuming ask of the buffer."""

    def check_fence(self):
        pass

    def settle(self, outcomes):
        return len(list(outcomes))


class Updater:
    """A LoRA updater's state as the books see it: (adapters, frozen base) split and joined."""

    def __init__(self, shift: float):
        self.params = ((jnp.full((8, 2), shift), jnp.full((2, 8), shift)), (jnp.arange(64.0).reshape(8, 8),))
        self.opt_state = {"mu": jnp.full((8, 2), shift)}
        self.ref_params = None

    def split(self, params):
        return params

    def join(self, train, frozen):
        return (train, frozen)


def books(tmp_path, lora: LoraSection) -> Durability:
    base = load_config(None, ["run.name=r1"])
    cfg = base.model_copy(update={"model": base.model.model_copy(update={"lora": lora})})
    return Durability(cfg, Buffer(), TrainerCheckpoints(str(tmp_path), keep=3, verify=False), "e1")


@pytest.mark.parametrize("changed", [{"alpha": 8.0}, {"rank": 4}, {"targets": ".*/q_proj"}])
def test_a_lora_run_resumed_with_other_settings_is_refused_naming_the_field(tmp_path, changed):
    trained = LoraSection(rank=2, alpha=32.0)
    first = books(tmp_path, trained)
    first.save(1, Updater(1.0), {})
    first.checkpoints.close()
    field, value = next(iter(changed.items()))
    was, now = (re.escape(f"model.lora.{field}={v!r}") for v in (getattr(trained, field), value))
    with pytest.raises(CheckpointMismatch, match=f"trained with {was}, and this config has {now}; set {was} to resume"):
        books(tmp_path, trained.model_copy(update=changed)).resume(Updater(0.0))
    resumed = books(tmp_path, trained).resume(Updater(0.0))  # the run's own settings resume it
    assert resumed.step == 1
    np.testing.assert_array_equal(np.asarray(resumed.state["params"][0][0]), np.full((8, 2), 1.0))


def test_a_frozen_base_that_cannot_be_written_names_the_directory_and_the_fix(tmp_path, monkeypatch):
    """The base is written at a LoRA run's first checkpoint, its largest write; on a full disk (reproduced on a small
    tmpfs) the trainer stopped with Orbax's bare `ValueError: RESOURCE_EXHAUSTED ...`, saying neither that it was the
    base nor what to do."""
    real = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self._final_path.name == "arrays":
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(self)
    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    first = books(tmp_path, LoraSection(rank=2, alpha=32.0))
    for step in (1, 2):  # a save after the failure writes the base again, not adapters without it
        with pytest.raises(CheckpointSaveFailed, match=rf"checkpoint.dir {tmp_path}: saving the LoRA run's frozen base "
                                                       r"to .*lora-base failed .*No space left on device.*Make room"):
            first.save(step, Updater(1.0), {})
    first.checkpoints.close()
    assert first.checkpoints.steps() == []  # and no step checkpoint holds adapters without their base
