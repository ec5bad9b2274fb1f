"""Trainer checkpoints on a real Orbax directory: newest valid one wins, damaged or partial ones are set aside,
a different layout is refused, a storage that does not answer is retried and never makes a checkpoint move,
commits are reported in order."""

import errno
import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path import atomicity

from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.trainer_service.checkpoints.errors import (CheckpointAccessDenied, CheckpointDirShared,
                                                            CheckpointDirUnusable, CheckpointSaveFailed)
from grpo_stream.trainer_service.checkpoints.store import (RECORD_FILE, CheckpointMismatch, CheckpointUnavailable,
                                                           TrainerCheckpoints, is_transient, tree_digest)


def state(shift: float) -> dict:
    params = {"w": jnp.arange(1024, dtype=jnp.float32) + shift, "b": jnp.full((3,), shift)}
    return {"params": params, "opt_state": optax.adam(1e-3).init(params)}


def saved(tmp_path, steps=(2, 4, 6), keep=3) -> TrainerCheckpoints:
    ckpt = TrainerCheckpoints(str(tmp_path), keep=keep, verify=True)
    for step in steps:
        ckpt.save(step, state(float(step)), {"note": step}, token=f"t{step}")
    assert [s for s, _ in ckpt.committed(wait=True)] == list(steps)
    return ckpt


def test_the_newest_checkpoint_is_restored_exactly_and_old_ones_are_pruned(tmp_path):
    saved(tmp_path, steps=(2, 4, 6, 8), keep=3)
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0))
    assert got.step == 8 and got.record["note"] == 8
    assert tree_digest(got.state) == tree_digest(state(8.0))
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [4, 6, 8]


@pytest.mark.parametrize("damage", ["flipped_bytes", "record_missing", "arrays_missing"])
def test_a_damaged_or_partial_newest_checkpoint_falls_back_to_the_one_before(tmp_path, damage):
    saved(tmp_path)
    newest = tmp_path / "6"
    if damage == "flipped_bytes":
        chunk = max((p for p in (newest / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2:len(data) // 2 + 32] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 32])
        chunk.write_bytes(bytes(data))
    elif damage == "record_missing":
        for p in sorted((newest / "record").rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    else:
        for p in (newest / "state").rglob("*"):
            if p.is_file() and p.stat().st_size > 1000:
                p.unlink()
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0))
    assert got.step == 4 and tree_digest(got.state) == tree_digest(state(4.0))
    assert len(list(tmp_path.glob("corrupt-6-*"))) == 1 and not newest.exists()


def test_an_unfinished_save_is_not_a_checkpoint(tmp_path):
    saved(tmp_path, steps=(2,))
    (tmp_path / "4.orbax-checkpoint-tmp-1234").mkdir()  # what a save cut off by kill -9 leaves
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0))
    assert got.step == 2


def test_a_checkpoint_of_another_layout_is_refused_and_kept(tmp_path):
    saved(tmp_path, steps=(2,))
    other = state(0.0)
    other["ref_params"] = other["params"]  # e.g. algo.beta turned on after the run started
    with pytest.raises(CheckpointMismatch, match="holds a different model or optimizer state"):
        TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(other)
    assert (tmp_path / "2").is_dir()


def flaky_storage(ckpt: TrainerCheckpoints, failures: int, error: Exception) -> list[int]:
    """Make the next `failures` reads of arrays fail with `error` (the storage not answering); returns the count
    of reads tried, which grows as the restore retries."""
    real, tried = ckpt._manager.restore, []

    def restore(step, args):
        if "state" in args.keys():
            tried.append(step)
            if len(tried) <= failures:
                raise ValueError("restore failed") from error  # Orbax wraps what tensorstore or the OS raised
        return real(step, args=args)
    ckpt._manager.restore = restore
    return tried


@pytest.mark.parametrize("error", [OSError(errno.ETIMEDOUT, "Connection timed out"),
                                   OSError(errno.ESTALE, "Stale file handle"),
                                   ValueError("UNAVAILABLE: Error reading gs://bucket/ckpt/6/state: 503")])
def test_a_storage_that_does_not_answer_is_retried_and_nothing_is_moved(tmp_path, error):
    saved(tmp_path)
    waits = []
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True, read_attempts=4, sleep=waits.append)
    tried = flaky_storage(ckpt, failures=2, error=error)
    got = ckpt.restore_latest(state(0.0))
    assert got.step == 6 and tried == [6, 6, 6] and len(waits) == 2  # the newest, on its third read
    assert not list(tmp_path.glob("corrupt-*")) and (tmp_path / "6").is_dir()


def test_a_storage_down_for_good_stops_the_restore_without_moving_anything(tmp_path):
    saved(tmp_path)
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True, read_attempts=3, sleep=lambda s: None)
    tried = flaky_storage(ckpt, failures=10, error=OSError(errno.EIO, "Input/output error"))
    with pytest.raises(CheckpointUnavailable, match="step 6 failed 3 times .* nothing was moved aside"):
        ckpt.restore_latest(state(0.0))
    assert tried == [6, 6, 6]  # never fell back to an older checkpoint on a storage failure
    assert not list(tmp_path.glob("corrupt-*")) and all((tmp_path / str(s)).is_dir() for s in (2, 4, 6))


def test_a_restore_failing_here_on_files_that_match_their_digest_moves_nothing(tmp_path):
    """Host or device memory, a device error: the files are sound (their digest matches), so the same failure would
    meet every older checkpoint, move them all aside and leave the run nothing to resume from."""
    saved(tmp_path)
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True, read_attempts=2, sleep=lambda s: None)
    flaky_storage(ckpt, failures=10, error=MemoryError("host memory"))
    with pytest.raises(CheckpointUnavailable, match="step 6 matches its digest but could not be restored here"):
        ckpt.restore_latest(state(0.0))
    assert not list(tmp_path.glob("corrupt-*")) and all((tmp_path / str(s)).is_dir() for s in (2, 4, 6))


@pytest.mark.parametrize("unreadable", ["record", "arrays"])
def test_files_this_user_may_not_read_stop_the_restore_and_move_nothing(tmp_path, monkeypatch, unreadable):
    """Files another user wrote (umask 077) fail to read in every checkpoint alike: setting them aside one after
    another as corrupt would leave nothing to resume from. The error says so, and a restart meets it again."""
    saved(tmp_path)
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=unreadable == "record", read_attempts=2,
                              sleep=lambda s: None)
    denied = PermissionError(errno.EACCES, "Permission denied")
    if unreadable == "arrays":  # without verify, Orbax's read is the first to meet them
        flaky_storage(ckpt, failures=10, error=denied)
    else:
        real = type(ckpt.directory).read_text

        def read_text(path, *args, **kwargs):
            if str(path).endswith(RECORD_FILE):
                raise denied
            return real(path, *args, **kwargs)
        monkeypatch.setattr(type(ckpt.directory), "read_text", read_text)
    with pytest.raises(CheckpointAccessDenied, match=r"may not read the checkpoint of step 6 .*nothing was moved "
                                                     r"aside. Give this user read access") as raised:
        ckpt.restore_latest(state(0.0))
    assert isinstance(raised.value, PermanentError)  # `up` stops the run rather than restart it into the same wall
    assert not list(tmp_path.glob("corrupt-*")) and all((tmp_path / str(s)).is_dir() for s in (2, 4, 6))


def test_a_damaged_record_of_another_layout_falls_back_instead_of_stopping_the_run(tmp_path):
    """The digest is checked before the layout: a record whose bytes were damaged (here: its layout) is a damaged
    checkpoint, the previous one's turn, not a config change that stops the run."""
    saved(tmp_path)
    record = next(p for p in (tmp_path / "6" / "record").rglob("*") if p.is_file() and p.stat().st_size > 20)
    text = record.read_text()
    assert '"layout"' in text
    record.write_text(text.replace('"layout"', '"layout_"', 1).replace('"layout_": ', '"layout": "x", "was": ', 1))
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0))
    assert got.step == 4 and len(list(tmp_path.glob("corrupt-6-*"))) == 1


def test_only_storage_failures_count_as_transient():
    assert is_transient(TimeoutError()) and is_transient(ConnectionResetError())
    assert is_transient(ValueError("DEADLINE_EXCEEDED: read of gs://b/x"))
    assert not is_transient(FileNotFoundError(errno.ENOENT, "No such file"))
    assert not is_transient(ValueError("DATA_LOSS: Error reading chunk: checksum mismatch"))
    assert not is_transient(ValueError("NOT_FOUND: Error opening \"zarr\" driver"))


def test_commits_are_reported_once_in_order(tmp_path):
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=False)
    ckpt.save(1, state(1.0), {}, token="a")
    ckpt.save(2, state(2.0), {}, token="b")  # Orbax finishes the first before starting the second
    first = ckpt.committed()
    rest = ckpt.committed(wait=True)
    assert [t for _, t in first + rest] == ["a", "b"] and ckpt.committed(wait=True) == []
    got = ckpt.restore_latest(state(0.0))
    assert got.step == 2 and np.array_equal(np.asarray(got.state["params"]["w"]), np.asarray(state(2.0)["params"]["w"]))


def frozen(shift: float) -> tuple:
    """A LoRA run's frozen base as the updater splits it: a tuple of the non-trained leaves."""
    return (jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) + shift, jnp.full((64,), shift))


def tree_bytes(path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_lora_base_is_written_once_and_restored_exactly(tmp_path):
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    ckpt.save_base(frozen(2.0))  # e.g. a run that stopped before its first checkpoint
    ckpt.save_base(frozen(1.0))  # the run that starts afresh in the directory writes its own
    adapters = {"adapters": (jnp.ones((64, 2)), jnp.zeros((2, 64)))}
    for step in (1, 2):
        ckpt.save(step, adapters, {}, token=step)
    ckpt.committed(wait=True)
    # the step checkpoints hold the adapters only
    assert all(tree_bytes(tmp_path / str(s)) < 0.5 * tree_bytes(tmp_path / "lora-base") for s in (1, 2))
    again = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    assert again.steps() == [1, 2]  # the base directory is not taken for a step
    got = again.restore_base(frozen(0.0))
    assert tree_digest(got) == tree_digest(frozen(1.0))


def test_a_missing_lora_base_stops_the_resume_and_names_the_directory(tmp_path):
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    with pytest.raises(CheckpointMismatch, match="lora-base.* is missing"):
        ckpt.restore_base(frozen(0.0))
    ckpt.save_base(frozen(1.0))
    (tmp_path / "lora-base" / "record.json").unlink()  # a save cut off before its record: written again next time
    with pytest.raises(CheckpointMismatch, match="is missing or was cut off"):
        ckpt.restore_base(frozen(0.0))
    ckpt.save_base(frozen(1.0))
    assert tree_digest(ckpt.restore_base(frozen(0.0))) == tree_digest(frozen(1.0))


def test_a_lora_base_of_another_model_or_damaged_is_refused(tmp_path):
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    ckpt.save_base(frozen(1.0))
    with pytest.raises(CheckpointMismatch, match="is of another model"):
        ckpt.restore_base((jnp.zeros((64, 32)), jnp.zeros((64,))))
    chunk = max((p for p in (tmp_path / "lora-base" / "arrays").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size)
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2:len(data) // 2 + 32] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 32])
    chunk.write_bytes(bytes(data))
    with pytest.raises(CheckpointMismatch):  # tensorstore's checksum or the saved SHA-256 catches it
        ckpt.restore_base(frozen(0.0))


@pytest.mark.parametrize("record", ['{"layout": "ab', "[1, 2]", ""])
def test_a_lora_base_whose_record_is_cut_off_or_edited_is_refused_for_good(tmp_path, record):
    """record.json cut off (a power loss after its rename) or edited: an error naming the base and the fix that
    stops the run, not a bare JSONDecodeError that a supervisor restarts the trainer into again and again."""
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    ckpt.save_base(frozen(1.0))
    (tmp_path / "lora-base" / "record.json").write_text(record)
    with pytest.raises(CheckpointMismatch, match="the frozen base in .*lora-base cannot be read .*restore it from a "
                                                 "copy"):
        ckpt.restore_base(frozen(0.0))


@pytest.fixture
def disk_full_at(monkeypatch):
    """Orbax's background commit of the given steps fails as on a full disk (reproduced on a small tmpfs: the error
    reaches the trainer once, and a later look at the saves reported the failed step as committed)."""
    failing: set[int] = set()
    real = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self._final_path.name.isdigit() and int(self._final_path.name) in failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(self)
    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    return failing


@pytest.mark.parametrize("verify", [False, True])
def test_a_save_that_failed_is_never_reported_as_committed(tmp_path, disk_full_at, verify):
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=verify)
    disk_full_at.add(4)
    ckpt.save(2, state(2.0), {}, token=2)
    ckpt.save(4, state(4.0), {}, token=4)
    reported, errors = [], []
    for step in (6, 8):  # a caller that goes on after the error (the trainer stops; a follower may look again)
        for call in (lambda: ckpt.save(step, state(float(step)), {}, token=step), lambda: ckpt.committed(wait=True)):
            try:
                reported += [token for _, token in call() or []]
            except Exception as exc:  # noqa: BLE001 - which ones, and what they say, is checked below
                errors.append(exc)
    assert 4 not in reported and not (tmp_path / "4").exists()
    assert errors and all(isinstance(e, CheckpointSaveFailed) for e in errors)
    assert all(f"checkpoint.dir {tmp_path}: saving the checkpoint of step 4 failed" in str(e) and "free space" in str(e)
               for e in errors)
    with pytest.raises(CheckpointSaveFailed):
        ckpt.close()
    assert TrainerCheckpoints(str(tmp_path), keep=3, verify=verify).restore_latest(state(0.0)).step == 2


def test_a_checkpoint_dir_that_is_a_file_names_the_field(tmp_path):
    (tmp_path / "ckpt").write_text("not a directory")
    with pytest.raises(CheckpointDirUnusable, match=r"checkpoint.dir .*ckpt cannot be used as the checkpoint "
                                                    r"directory .*FileExistsError"):
        TrainerCheckpoints(str(tmp_path / "ckpt"), keep=3, verify=True)


def test_a_second_trainer_writing_the_same_directory_stops_instead_of_overwriting(tmp_path):
    """Two runs given the same checkpoint.dir (started before either saved): the second's saves replaced the first's
    checkpoints under the same step numbers, and the first acknowledged groups against another run's state."""
    first = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    second = TrainerCheckpoints(str(tmp_path), keep=3, verify=True)
    # Orbax clears a new manager's directory of unfinished saves on a thread: the second's clearing deleted the
    # first's save under way now and then (a flaky NOT_FOUND), a race of starting, not the one this test is about
    second._manager._maybe_await_cleanup_tmp_directory()  # noqa: SLF001 - no public wait for it
    first.save(2, state(2.0), {"run": "a"}, token=2)
    assert first.committed(wait=True) == [(2, 2)]
    with pytest.raises(CheckpointDirShared, match=r"did not write \(steps \[2\]\) as it saves the one of step 2: "
                                                  r"another trainer writes into checkpoint.dir"):
        second.save(2, state(102.0), {"run": "b"}, token=2)
    with pytest.raises(CheckpointDirShared):  # and stays stopped
        second.committed(wait=True)
    first.save(6, state(6.0), {"run": "a"}, token=6)
    first.committed(wait=True)
    got = TrainerCheckpoints(str(tmp_path), keep=3, verify=True).restore_latest(state(0.0))
    assert got.step == 6 and got.record["run"] == "a" and tree_digest(got.state) == tree_digest(state(6.0))


def test_a_checkpoint_replaced_by_another_trainer_before_its_commit_is_reported_is_refused(tmp_path):
    ckpt = TrainerCheckpoints(str(tmp_path), keep=3, verify=False)
    ckpt.save(2, state(2.0), {}, token=2)
    ckpt._manager.wait_until_finished()
    record = next(p for p in (tmp_path / "2" / "record").rglob("*") if p.is_file() and p.stat().st_size > 20)
    text = json.loads(record.read_text())
    record.write_text(json.dumps({**text, "writer": "another trainer"}))  # its save of the same step won the rename
    with pytest.raises(CheckpointDirShared, match="checkpoint of step 2 in .* was written by another trainer"):
        ckpt.committed(wait=True)
