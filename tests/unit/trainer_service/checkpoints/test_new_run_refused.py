"""A trainer that finds no usable checkpoint for a run whose groups Redis already counts as trained refuses to start
it over, and says why: the checkpoints are elsewhere, or every one in checkpoint.dir was damaged and moved aside."""

from types import SimpleNamespace

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.checkpoints.durability import Durability
from grpo_stream.trainer_service.checkpoints.errors import RunRefused
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints
from tests.unit.trainer_service.checkpoints.test_store import saved, state


class Buffer:
    """The buffer as a starting trainer reads it: `trained` groups acknowledged so far."""

    def __init__(self, trained: int):
        self.trained, self.started = trained, []

    def counters(self) -> dict:
        return {"trained": self.trained}

    def log_trainer(self, epoch, step, previous):
        self.started.append(step)

    def set_held(self, held):
        pass


def books(tmp_path, trained: int) -> tuple[Durability, Buffer]:
    cfg = load_config(None, ["run.name=r1"])
    buffer = Buffer(trained)
    return Durability(cfg, buffer, TrainerCheckpoints(str(tmp_path), keep=3, verify=True), "e2"), buffer


def damage_every_checkpoint(tmp_path) -> None:
    for step in (2, 4, 6):
        chunk = max((p for p in (tmp_path / str(step) / "state").rglob("*") if p.is_file()),
                    key=lambda p: p.stat().st_size)
        chunk.write_bytes(chunk.read_bytes()[:10])


def test_a_run_whose_every_checkpoint_was_moved_aside_is_refused_naming_them(tmp_path):
    saved(tmp_path)
    damage_every_checkpoint(tmp_path)
    durability, _ = books(tmp_path, trained=8)
    assert durability.checkpoints.restore_latest(state(0.0)) is None  # each one set aside, none deleted
    with pytest.raises(RunRefused, match=r"8 trained groups, but every checkpoint in .* was unusable and was moved "
                                         r"aside \(corrupt-2-\d+, corrupt-4-\d+, corrupt-6-\d+; the log says why\)"):
        durability.begin_new_run()


def test_a_run_without_checkpoints_here_is_refused_or_started(tmp_path):
    durability, buffer = books(tmp_path, trained=8)
    with pytest.raises(RunRefused, match="has no checkpoint of it: point checkpoint.dir"):
        durability.begin_new_run()
    durability, buffer = books(tmp_path / "new", trained=0)
    durability.begin_new_run()
    assert buffer.started == [0]


def test_a_newest_checkpoint_another_run_wrote_here_is_refused_naming_its_step(tmp_path):
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    ckpt.save(2, state(2.0), {"run": "r1"}, token=2)
    ckpt.save(4, state(4.0), {"run": "someone-else"}, token=4)
    ckpt.committed(wait=True)
    durability, buffer = books(tmp_path, trained=0)
    updater = SimpleNamespace(params=state(0.0)["params"], opt_state=state(0.0)["opt_state"], ref_params=None,
                              split=lambda params: (params, None))
    with pytest.raises(RunRefused, match=r"newest usable checkpoint \(step 4\) belongs to run 'someone-else', not "
                                         r"run.name='r1'.* move its .*/4 out"):
        durability.resume(updater)
    assert (tmp_path / "2").is_dir() and (tmp_path / "4").is_dir() and buffer.started == []
