"""The checkpoint digest off the step's path: written by a background thread after Orbax's commit while the step
loop goes on, reported by `committed()` only once written, at most one behind the saves, checked on restore; a
checkpoint without it is set aside as unverified and the one before used."""

import errno
import json
import threading

import jax.numpy as jnp
import optax
import pytest
from etils import epath

from grpo_stream.trainer_service.checkpoints import digest as checkpoint_digest
from grpo_stream.trainer_service.checkpoints.digest import DIGEST_FILE
from grpo_stream.trainer_service.checkpoints.errors import CheckpointSaveFailed
from grpo_stream.trainer_service.checkpoints.store import TrainerCheckpoints, tree_digest


def state(shift: float) -> dict:
    params = {"w": jnp.arange(1024, dtype=jnp.float32) + shift, "b": jnp.full((3,), shift)}
    return {"params": params, "opt_state": optax.adam(1e-3).init(params)}


@pytest.fixture
def gated(monkeypatch):
    """Digests wait for `gate` before hashing; `order` records when each one is written and each save starts."""
    gate, order = threading.Event(), []
    real = checkpoint_digest.write_digest

    def write_digest(step_dir):
        gate.wait()
        real(step_dir)
        order.append(("digest", int(step_dir.name)))
    monkeypatch.setattr(checkpoint_digest, "write_digest", write_digest)
    return gate, order


def record_saves(ckpt: TrainerCheckpoints, order: list) -> None:
    real = ckpt._manager.save

    def save(step, args):
        order.append(("save", step))
        return real(step, args=args)
    ckpt._manager.save = save


def test_the_digest_is_written_after_the_commit_while_the_step_loop_goes_on(tmp_path, gated):
    gate, order = gated
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    record_saves(ckpt, order)
    ckpt.save(2, state(2.0), {}, token="t2")
    ckpt._manager.wait_until_finished()  # Orbax has committed; the digest waits for the gate
    assert ckpt.committed() == []  # returns at once: the step is not held, and 2 is not yet reported
    assert (tmp_path / "2").is_dir() and not (tmp_path / "2" / DIGEST_FILE).exists()
    ckpt.save(4, state(4.0), {}, token="t4")  # the newest checkpoint's digest may lag: this save does not wait
    assert order == [("save", 2), ("save", 4)]
    gate.set()
    assert ckpt.committed(wait=True) == [(2, "t2"), (4, "t4")]
    assert order[2:] == [("digest", 2), ("digest", 4)]
    listed = json.loads((tmp_path / "2" / DIGEST_FILE).read_text())["sha256"]
    assert any(name.startswith("state/") for name in listed) and any(name.startswith("record/") for name in listed)
    ckpt.close()
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0))
    assert got.step == 4 and tree_digest(got.state) == tree_digest(state(4.0))


def test_a_save_waits_for_the_digest_of_a_checkpoint_older_than_the_newest(tmp_path, gated):
    gate, order = gated
    ckpt = TrainerCheckpoints(str(tmp_path), keep=2, verify=True)  # the save of 6 prunes 2 once committed
    record_saves(ckpt, order)
    ckpt.save(2, state(2.0), {}, token=2)
    ckpt.save(4, state(4.0), {}, token=4)
    ckpt._manager.wait_until_finished()
    third = threading.Thread(target=ckpt.save, args=(6, state(6.0), {}), kwargs={"token": 6})
    third.start()
    third.join(timeout=0.5)
    assert third.is_alive()  # held until the digest of 2 is written
    gate.set()
    third.join()
    # and, with keep=2, the newest's (4) too: the commit of 6 leaves 4 and 6 only, and one of them must be verified
    # should the trainer die before the digest of 6 is written
    assert order.index(("digest", 2)) < order.index(("save", 6)) and order.index(("digest", 4)) < order.index(
        ("save", 6))
    assert [s for s, _ in ckpt.committed(wait=True)] == [2, 4, 6]
    ckpt.close()
    assert all((tmp_path / str(s) / DIGEST_FILE).exists() for s in (4, 6))


def saved(tmp_path, steps=(2, 4, 6)) -> None:
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    for step in steps:
        ckpt.save(step, state(float(step)), {}, token=step)
    assert [s for s, _ in ckpt.committed(wait=True)] == list(steps)
    ckpt.close()


@pytest.mark.parametrize("damage", ["missing", "cut_off"])
def test_a_checkpoint_without_its_digest_is_set_aside_as_unverified_and_the_one_before_used(tmp_path, damage):
    saved(tmp_path)
    digest = tmp_path / "6" / DIGEST_FILE
    if damage == "missing":  # the trainer died between Orbax's commit and the digest
        digest.unlink()
    else:
        digest.write_text(digest.read_text()[:40])
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0))
    assert got.step == 4 and tree_digest(got.state) == tree_digest(state(4.0))
    assert len(list(tmp_path.glob("unverified-6-*"))) == 1 and not list(tmp_path.glob("corrupt-*"))


def test_without_verify_a_missing_digest_is_not_needed(tmp_path):
    saved(tmp_path)
    (tmp_path / "6" / DIGEST_FILE).unlink()
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=False).restore_latest(state(0.0))
    assert got.step == 6


def test_an_edited_record_is_refused_like_damaged_arrays(tmp_path):
    saved(tmp_path)
    record = next(p for p in (tmp_path / "6" / "record").rglob("*") if p.is_file() and p.name != "commit_success.txt")
    record.write_bytes(record.read_bytes() + b" ")
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0))
    assert got.step == 4 and len(list(tmp_path.glob("corrupt-6-*"))) == 1


def test_files_added_beside_a_checkpoint_do_not_reject_it(tmp_path):
    saved(tmp_path)
    (tmp_path / "6" / "state" / ".nfs000000001").write_bytes(b"left by NFS")
    assert TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0)).step == 6


def test_a_step_another_process_set_aside_is_saved_again_here(tmp_path):
    """A multi-process trainer: process 0 moves an unverified checkpoint aside while process 1's manager still lists
    it; at that step's next save process 1 must write it (Orbax skips a step it lists), or process 0's save waits
    for it for ever (seen in the kill -9 test of a 2-process trainer)."""
    first = TrainerCheckpoints(str(tmp_path), keep=5, verify=False)
    for step in (2, 4, 6):
        first.save(step, state(float(step)), {}, token=step)
    assert [s for s, _ in first.committed(wait=True)] == [2, 4, 6]
    first.close()
    follower = TrainerCheckpoints(str(tmp_path), keep=5, verify=False)  # lists 2, 4, 6
    (tmp_path / "6").rename(tmp_path / "unverified-6-0")  # what process 0 does with a checkpoint without digest
    follower.save(6, state(60.0), {}, token="again")
    assert follower.committed(wait=True) == [(6, "again")]
    assert (tmp_path / "6").is_dir() and follower.steps() == [2, 4, 6]
    follower.close()


def test_a_digest_that_cannot_be_written_says_which_checkpoint_and_the_fix(tmp_path, monkeypatch):
    """A checkpoint that fills the disk leaves no room for its digest (reproduced on a small tmpfs): the trainer
    stopped with a bare `OSError: [Errno 28] No space left on device` naming neither checkpoint.dir nor the step,
    and left the cut-off temporary digest file beside the checkpoint."""
    real = epath.gpath.PosixGPath.write_text

    def write_text(self, data, *args, **kwargs):
        if self.name == f"{DIGEST_FILE}.tmp" and self.parent.name == "4":
            real(self, data[:10], *args, **kwargs)  # what fitted before the disk was full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, *args, **kwargs)
    monkeypatch.setattr(epath.gpath.PosixGPath, "write_text", write_text)
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    ckpt.save(2, state(2.0), {}, token=2)
    assert ckpt.committed(wait=True) == [(2, 2)]
    ckpt.save(4, state(4.0), {}, token=4)
    for look in (lambda: ckpt.committed(wait=True), lambda: ckpt.save(6, state(6.0), {}, token=6)):
        with pytest.raises(CheckpointSaveFailed, match=rf"checkpoint.dir {tmp_path}: writing the SHA-256 digest of the "
                                                       r"checkpoint of step 4 .*No space left on device.*Make room"
                                                       r".*unverified-<step>-<time> can go"):
            look()
    assert not (tmp_path / "4" / f"{DIGEST_FILE}.tmp").exists()
    monkeypatch.undo()
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0))
    assert got.step == 2 and len(list(tmp_path.glob("unverified-4-*"))) == 1


def test_a_restore_beats_while_it_hashes_the_checkpoints_files(tmp_path, monkeypatch):
    """Hashing a large model's checkpoint (a TB at full size) before its restore outlasts up.trainer_stall_s: without
    a beat while it reads, `up` took the trainer for hung and restarted it into the same check, again and again."""
    ckpt = TrainerCheckpoints(str(tmp_path / "ckpt"), keep=3, verify=True)
    ckpt.save(2, state(2.0), {}, token="t2")
    assert ckpt.committed(wait=True) == [(2, "t2")]
    ckpt.close()
    monkeypatch.setattr(checkpoint_digest, "_PIECE", 256)  # many reads of a small checkpoint, as of a large one
    beats = []
    again = TrainerCheckpoints(str(tmp_path / "ckpt"), keep=3, verify=True)
    again.progress = lambda: beats.append(1)
    restored = again.restore_latest(state(0.0))
    assert restored.step == 2 and float(restored.state["params"]["b"][0]) == 2.0
    assert len(beats) >= 8, len(beats)
    again.close()
