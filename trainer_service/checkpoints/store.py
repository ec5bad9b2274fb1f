"""Trainer checkpoints: Orbax saves of the whole training state, verified on restore.

A checkpoint of step s holds the parameters and optimizer state (each device writes its own shards, and
restore places them straight into the trainer mesh's shardings) and a JSON record: step, weight version,
the trainer epoch that wrote it, the groups trained but not yet acknowledged in the buffer, the data and buffer
positions, earlier evaluation results and the settings its layout follows from (a resume under others is refused
naming them: errors.layout_mismatch). With checkpoint.verify, the SHA-256s of its files are
written beside them once it is committed (digest.py), on a background thread.

Saves are asynchronous: `save` returns once the arrays are copied off the devices and Orbax commits
in the background (the directory appears under its final name only when complete). `committed()` says
which saves have finished, digest included, so the trainer acknowledges groups only once their update is on disk
and verifiable. A step waits for a digest only when it starts a save while the digest of a checkpoint older than
the newest one is still being written (at most one digest is ever behind the saves, and none is pruned mid-hash).

With LoRA the frozen base is written once per run, to `lora-base/` (`save_base`), and each step's checkpoint
holds the adapters and their optimizer state only: a 70B model's base is 140 GB in bfloat16, its rank-16 adapters
under 1 GB. A resume reads the base back from there (`restore_base`), checked against the layout and digest saved
with it.

Restore walks from the newest step down: a checkpoint that fails to load or whose files do not match
their digest is moved aside to `corrupt-<step>-<time>` (kept for inspection) and the one before is used. With
verify on, one without its digest (the process died after the commit, before the digest was written) is moved
to `unverified-<step>-<time>` and the one before is used too: nothing is lost, as groups are acknowledged only
through the checkpoint before the newest committed one.
A failure that only says the storage did not answer (a timeout, a dropped connection, a stale NFS handle,
tensorstore's UNAVAILABLE) says nothing about the checkpoint: it is retried with back-off and, if it lasts,
the restore stops with CheckpointUnavailable and moves nothing, since moving a sound checkpoint aside on a
network blip, twice in a row, would lose the window of groups it holds.
In a trainer of several processes, process 0 alone walks the steps (`choose_step`) and every process restores the
step it chose (`agree_step`): a process that cannot read that step stops the job with CheckpointDisagreement
rather than restore another, as processes holding shards of different steps would train on a mix of both.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp
from etils import epath

from grpo_stream.common.runtime.backoff import Backoff
from grpo_stream.trainer_service.checkpoints.digest import (DigestMissing, DigestWriter, check_digest, tree_digest,
                                                           tree_layout)
from grpo_stream.trainer_service.checkpoints.errors import (CheckpointDisagreement, CheckpointMismatch,  # noqa: F401
                                                           CheckpointRejected, CheckpointUnavailable,
                                                           CheckpointUnverified, StorageBlip, access_denied,
                                                           dir_shared, dir_unusable, is_access_denied, is_transient,
                                                           layout_mismatch, save_failed)
from grpo_stream.trainer_service.checkpoints.lora_base import restore_base, save_base

log = logging.getLogger(__name__)
RECORD_FILE = "record/metadata"  # where Orbax's JsonSave of item `record` writes it (its default file name)
_UNAGREED = object()  # a multi-process trainer's restore step before process 0 chose it


@dataclasses.dataclass
class Restored:
    step: int
    state: dict  # params, opt_state (and ref_params when a KL reference is held)
    record: dict


class TrainerCheckpoints:
    def __init__(self, directory: str, keep: int, verify: bool, read_attempts: int = 5,
                 sleep: Callable[[float], None] = time.sleep):
        """`read_attempts`: tries at reading one checkpoint while its storage fails to answer (with back-off)."""
        self.directory = epath.Path(directory)
        self.verify, self.read_attempts, self._sleep, self.keep = verify, read_attempts, sleep, keep
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError, PermissionError) as exc:
            raise dir_unusable(self.directory, exc) from exc
        self._manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, cleanup_tmp_directories=True))
        self._in_flight: list[tuple[int, Any]] = []  # (step, token) of saves not yet known to be committed
        # (step, token, digest being written or None) of committed saves not yet reported; only process 0 writes
        # digests (the directory is shared), the others report their saves once committed
        self._digesting: list[tuple[int, Any, concurrent.futures.Future | None]] = []
        self._digests = DigestWriter() if verify and jax.process_index() == 0 else None
        self._newest_saved: int | None = None
        self._agreed: Any = _UNAGREED  # the step every process restores (a trainer of several processes)
        # another trainer's saves here are told apart by their steps (any but those here at the start or saved here)
        self._known, self._writer = self._listed(), uuid.uuid4().hex  # and by the writer each record names
        self._failed, self.progress = None, None  # see _fail; a heartbeat while a restore hashes (check_digest)

    def _listed(self) -> set[int]:
        return {int(p.name) for p in self.directory.iterdir() if p.name.isdigit()}

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def moved_aside(self) -> list[str]:
        """The checkpoints a restore moved aside (`corrupt-<step>-<time>`, `unverified-<step>-<time>`), by name."""
        return sorted(p.name for p in self.directory.iterdir() if p.name.startswith(("corrupt-", "unverified-")))

    def save(self, step: int, state: dict, record: dict, token: Any = None) -> None:
        """Start saving `state` (a pytree of arrays) as step `step`; `token` comes back from `committed()` once
        it is on disk (and its digest written)."""
        if self._failed is not None:
            raise self._failed
        record = {**record, "step": step, "saved_unix": time.time(), "layout": tree_layout(state),
                  "writer": self._writer}
        if self.verify:
            record["files_digest"] = True  # a restore with verify on needs the digest file (digest.py)
        self._collect()
        # else Orbax replaces another trainer's checkpoint (the step may be there: gs:// with several processes)
        foreign = sorted(self._listed() - self._known - ({step} if jax.process_count() > 1 else set()))
        if foreign:
            raise self._fail(dir_shared(self.directory, f"it holds checkpoints this trainer did not write (steps "
                                                        f"{foreign}) as it saves the one of step {step}"))
        if step in self._manager.all_steps() and not (self.directory / str(step)).exists():
            # another process of a multi-process trainer set this step's checkpoint aside (restore_latest) after
            # this manager listed it: without a fresh listing Orbax would skip the save here while the others save,
            # and their save would wait for this process for ever
            self._manager.reload()
        # the backlog stays at one digest: the newest checkpoint's may still be written while this save runs, an
        # older one's must be done (this save's commit may prune that checkpoint). With keep=2 a commit that prunes
        # leaves only the newest and this one, so the newest's digest must be done too: else a crash right after it
        # could leave no verified checkpoint to resume from
        whole = self.keep <= 2 and self._digests is not None and len(self._manager.all_steps()) >= self.keep
        if whole:
            self._collect(wait=True)
        for older, _, digest in self._digesting:  # and one that failed (a full disk) stops the saves here
            if digest is not None and (whole or digest.done() or (self._newest_saved is not None
                                                                   and older < self._newest_saved)):
                digest.result()
        self._known.add(step)
        try:
            saving = self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                      record=ocp.args.JsonSave(record)))
        except Exception as exc:  # noqa: BLE001 - the previous save's failure too (Orbax waits for it here)
            raise self._fail(save_failed(self.directory, self._unfinished(self._in_flight) or [step], exc)) from exc
        if not saving:  # Orbax skips a step not newer than its newest: it would never be written
            raise self._fail(dir_shared(self.directory, f"it holds step {self._manager.latest_step()}, not older "
                                                        f"than step {step} this trainer saves (a step newer than the "
                                                        "one this trainer resumed from)"))
        self._in_flight.append((step, token))
        self._newest_saved = step

    def committed(self, wait: bool = False) -> list[tuple[int, Any]]:
        """(step, token) of saves that finished since the last call, digest included, oldest first; `wait` blocks
        until all have. Raises what a background save or digest raised (CheckpointSaveFailed for a save)."""
        if self._failed is not None:
            raise self._failed
        self._collect(wait)
        done = []
        while self._digesting:
            step, token, digest = self._digesting[0]
            if digest is not None:
                if not (wait or digest.done()):
                    break
                digest.result()
            done.append((step, token))
            self._digesting.pop(0)
        return done

    def _collect(self, wait: bool = False) -> None:
        """Start the digests of saves Orbax has committed since the last look (all of them after waiting)."""
        if not self._in_flight:
            return
        try:  # Orbax raises a save's failure once, not always before it says no save is in progress: a step is done
            # once on the storage, and a failure is kept (_fail), so a failed step is never reported
            if wait:
                self._manager.wait_until_finished()
            if not wait and self._manager.is_saving_in_progress():
                # saves finish in order: all but the newest are done once a newer one has started
                done, rest = self._in_flight[:-1], self._in_flight[-1:]
            else:
                self._manager.check_for_errors()
                done, rest = self._in_flight, []
            if jax.process_index() == 0 and self._unfinished(done):  # process 0 commits every process's save
                self._manager.wait_until_finished()  # raises what the save raised
                raise RuntimeError("Orbax finished the save but the checkpoint is not on the storage")
        except Exception as exc:  # noqa: BLE001 - a full disk, a storage that refused the write
            raise self._fail(save_failed(self.directory, self._unfinished(self._in_flight) or
                                         [s for s, _ in self._in_flight], exc)) from exc
        self._in_flight = rest
        for step, token in done:
            self._check_writer(step)
            digest = None if self._digests is None else self._digests.submit(self.directory / str(step))
            self._digesting.append((step, token, digest))

    def _fail(self, exc: Exception) -> Exception:
        self._failed = exc  # raised again by every later save and look at the saves
        return exc

    def _unfinished(self, saves: list[tuple[int, Any]]) -> list[int]:
        """The steps of `saves` ((step, token)) that are not (completely) on the storage."""
        return [s for s, _ in saves if not ocp.step.is_checkpoint_finalized(self.directory / str(s))]

    def _check_writer(self, step: int) -> None:
        """Raise CheckpointDirShared when another trainer's save of `step` replaced this one's (process 0 writes
        the record; one that does not read is left to the restore, which checks it)."""
        if jax.process_index() != 0:
            return
        try:
            writer = json.loads((self.directory / str(step) / RECORD_FILE).read_text()).get("writer", self._writer)
        except Exception:  # noqa: BLE001
            writer = self._writer
        if writer != self._writer:
            raise self._fail(dir_shared(self.directory, f"the checkpoint of step {step} in {self.directory} was "
                                                        "written by another trainer"))

    def restore_latest(self, state_like: dict, settings: dict | None = None) -> Restored | None:
        """The newest checkpoint that loads and verifies, placed like `state_like` (arrays with shardings); None
        when there is none. Rejected ones are moved aside and logged. In a trainer of several processes: the step
        process 0 chose for all (`choose_step` / `agree_step`), or an error. `settings`: this run's layout settings
        (durability.layout_settings), which a CheckpointMismatch compares with those saved in the record."""
        if jax.process_count() > 1:
            return self.restore_agreed(state_like, settings)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                restored = self._retrying(step, lambda: self._restore(step, abstract, settings=settings))
            except CheckpointRejected as exc:
                self._set_aside(step, exc)
                continue
            log.info("resuming from the checkpoint of step %d (%s)", step, self.directory / str(step))
            return restored
        return None

    # -- a trainer of several processes: one step for all ---------------------------------------------------------
    # Each process reads its own shards, and Orbax ends every restore at a barrier counted per process; were each to
    # walk the steps itself, one that fails to read step N (a read error on its host only) would go on to N-1 while
    # the others restore N, the barriers would still pair up, and the collectives would then run on mixed shards.
    # So process 0 alone judges the steps (record and files, read directly: no barrier), every process restores the
    # step it chose, and one that cannot read it stops the job instead of restoring another.
    def choose_step(self) -> int | None:
        """Process 0: the newest step whose record reads and, with checkpoint.verify, whose files match their digest
        (rejected ones are moved aside, as restore_latest does); None when there is none. Send it to the others, who
        call `agree_step` with it; every process's restore_latest then restores it."""
        self._agreed = None
        for step in sorted(self._manager.all_steps(), reverse=True):
            try:
                self._retrying(step, lambda: self._check_step(step))
            except CheckpointRejected as exc:
                self._set_aside(step, exc)
                continue
            self._agreed = step
            break
        return self._agreed

    def agree_step(self, step: int | None) -> None:
        """Processes other than 0: restore_latest restores `step` (process 0's `choose_step`), whatever this process
        lists, or stops with CheckpointDisagreement when it cannot."""
        self._manager.reload()  # process 0 may have moved newer steps aside since this manager listed them
        if step is not None and step not in self._manager.all_steps():
            raise CheckpointDisagreement(
                f"trainer process {jax.process_index()}: checkpoint.dir {self.directory} does not hold the checkpoint "
                f"of step {step}, which trainer process 0 chose for every process (it holds {self.steps()}): every "
                "host must see the same checkpoint.dir (shared storage); the job stops rather than restore another "
                "step")
        self._agreed = step

    def restore_agreed(self, state_like: dict, settings: dict | None = None) -> Restored | None:
        step = self._agreed
        if step is _UNAGREED:
            raise RuntimeError("a trainer of several processes restores only the step process 0 chose: call "
                               "choose_step (process 0) or agree_step (the others) first")
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
        process = jax.process_index()
        # nothing is moved aside here: process 0 judged the step (record, and the files' digest with verify) before
        # choosing it, and a read that fails now may be a peer's failure (a process that died makes the restore's
        # collectives fail here), which says nothing about the checkpoint
        try:
            restored = self._retrying(step, lambda: self._restore(step, abstract, False, settings))
        except CheckpointRejected as exc:
            raise CheckpointDisagreement(
                f"trainer process {process} cannot read the checkpoint of step {step} in {self.directory}, which "
                f"trainer process 0 chose for every process ({exc}); the job stops rather than let its processes "
                "restore different steps. If another trainer process failed first, its log says why; else make "
                "this checkpoint readable from this host" + ("" if self.verify else
                                                              " (checkpoint.verify would have set a damaged one aside)")
            ) from exc
        log.info("resuming from the checkpoint of step %d (%s), as every trainer process", step,
                 self.directory / str(step))
        return restored

    def _set_aside(self, step: int, exc: CheckpointRejected) -> None:
        """Move a rejected checkpoint aside (process 0 only: the directory is shared) and forget it."""
        unverified = isinstance(exc, CheckpointUnverified)
        aside = self.directory / f"{'unverified' if unverified else 'corrupt'}-{step}-{int(time.time())}"
        if jax.process_index() == 0:
            log.log(logging.WARNING if unverified else logging.ERROR, "checkpoint of step %d in %s is %s (%s); moved "
                    "to %s, trying the one before", step, self.directory, "unverified" if unverified else "unusable",
                    exc, aside)
            (self.directory / str(step)).rename(aside)
        self._manager.reload()  # the step is gone (or going) from the listing

    def _retrying(self, step: int, read: Callable[[], Any]) -> Any:
        """`read()` of the checkpoint of `step`, tried again with back-off while the storage does not answer."""
        backoff = Backoff(1.0, 15.0)
        for attempt in range(1, self.read_attempts + 1):
            try:
                return read()
            except CheckpointRejected as exc:  # a file this user may not read: so is every other checkpoint's
                if is_access_denied(exc):
                    raise access_denied(self.directory, f"the checkpoint of step {step}", exc) from exc
                raise
            except StorageBlip as blip:
                cause = blip.__cause__
                if attempt == self.read_attempts:
                    raise CheckpointUnavailable(
                        f"checkpoint.dir {self.directory}: reading the checkpoint of step {step} failed "
                        f"{attempt} times because the storage did not answer ({type(cause).__name__}: "
                        f"{str(cause)[:300]}); nothing was moved aside. Check the storage, then start the trainer "
                        "again") from cause
                delay = backoff.next()
                log.warning("checkpoint of step %d: the storage did not answer (%s: %s); attempt %d of %d in %.1fs",
                            step, type(cause).__name__, str(cause)[:200], attempt + 1, self.read_attempts, delay)
                self._sleep(delay)
        raise AssertionError("unreachable")

    def _check_step(self, step: int, abstract: Any = None, check_files: bool = True,
                    settings: dict | None = None) -> dict:
        """The record of `step`, checked before any array is read: it names the step, the layout matches
        `abstract` (when given; else CheckpointMismatch naming the `settings` that differ from the record's), and
        with verify the files match their digest (when `check_files`)."""
        path = self.directory / str(step) / RECORD_FILE
        try:  # read directly, not through Orbax: its restores are collective (see choose_step)
            record = json.loads(path.read_text())
        except Exception as exc:  # noqa: BLE001 - an unreadable record is a partial or damaged checkpoint
            if is_transient(exc):
                raise StorageBlip() from exc
            raise CheckpointRejected(f"its record is unreadable: {type(exc).__name__}: {str(exc)[:300]}") from exc
        if not isinstance(record, dict) or record.get("step") != step:
            named = record.get("step") if isinstance(record, dict) else None
            raise CheckpointRejected(f"its record names step {named}")
        if check_files and self.verify and record.get("files_digest"):
            # before any array is read onto the devices, and before the layout is judged: a damaged record is the
            # previous checkpoint's turn, not a permanent mismatch that stops the run
            self._check_files(step)
        if abstract is not None and record.get("layout") not in (None, tree_layout(abstract)):
            raise CheckpointMismatch(layout_mismatch(self.directory, step, record.get("settings"), settings))
        return record

    def _restore(self, step: int, abstract: Any, check_files: bool = True, settings: dict | None = None) -> Restored:
        # the small JSON record first: a partial checkpoint or another layout is told apart before any array is read
        record = self._check_step(step, abstract, check_files, settings)
        try:
            state = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract)))["state"]
        except Exception as exc:  # noqa: BLE001 - any other failure to read means "use the previous one"
            if is_transient(exc):
                raise StorageBlip() from exc
            if check_files and self.verify and record.get("files_digest"):
                # its files match their digest: the failure is this process's (host or device memory, a device
                # error), which would meet every older checkpoint too and move them all aside
                raise CheckpointUnavailable(f"the checkpoint of step {step} matches its digest but could not be "
                                            f"restored here: {type(exc).__name__}: {str(exc)[:300]}") from exc
            raise CheckpointRejected(f"{type(exc).__name__}: {str(exc)[:300]}") from exc
        # checkpoints written before the files' digest carry a SHA-256 of their arrays in the record (a gather: every
        # process of a multi-process trainer computes it, in the same order)
        if self.verify and isinstance(record.get("digest"), str) and tree_digest(state) != record["digest"]:
            raise CheckpointRejected("its arrays do not match the SHA-256 saved with them")
        return Restored(step, state, record)

    def _check_files(self, step: int) -> None:
        """Raises CheckpointRejected when a file of the checkpoint differs from its digest, CheckpointUnverified
        when the digest file is missing, StorageBlip when the storage did not answer."""
        try:
            problem = check_digest(self.directory / str(step), self.progress)
        except DigestMissing as exc:
            raise CheckpointUnverified(f"saved with checkpoint.verify, but {exc} (the trainer stopped before "
                                       "writing it)") from exc
        except Exception as exc:  # noqa: BLE001 - as reading the arrays: the storage, or a damaged checkpoint
            if is_transient(exc):
                raise StorageBlip() from exc
            raise CheckpointRejected(f"its files cannot be read: {type(exc).__name__}: {str(exc)[:300]}") from exc
        if problem is not None:
            raise CheckpointRejected(problem)

    def save_base(self, frozen: Any, settings: dict | None = None) -> None:
        """A LoRA run's frozen base, written once with the run's model.lora `settings` (lora_base.py)."""
        save_base(self.directory, frozen, self.verify, settings)

    def restore_base(self, frozen_like: Any) -> Any:
        """The frozen base `save_base` wrote, placed like `frozen_like` (lora_base.py)."""
        return restore_base(self.directory, frozen_like, self.verify)

    def close(self) -> None:
        """Wait for the saves and their digests (a committed checkpoint without its digest would be set aside by
        the next restore)."""
        try:
            self._manager.wait_until_finished()
            self.committed(wait=True)
        finally:
            if self._digests is not None:
                self._digests.close()
            self._manager.close()
