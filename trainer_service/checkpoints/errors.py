"""What a checkpoint restore can conclude, as exceptions, and which read failures are the storage's rather than
the checkpoint's (store.py retries those and never moves a checkpoint aside for them), and which are this user's
(a file it may not read: every checkpoint would fail alike, so the restore stops and moves nothing)."""

from __future__ import annotations

import errno
import json
import os
import re
from typing import Callable

from grpo_stream.common.runtime.errors import PermanentError


class CheckpointRejected(RuntimeError):
    """A checkpoint directory that cannot be used (unreadable, partial, or its files do not match their digest)."""


class CheckpointUnverified(CheckpointRejected):
    """A checkpoint saved with checkpoint.verify whose digest was never (completely) written."""


class CheckpointMismatch(PermanentError, ValueError):
    """A sound checkpoint of a different model or optimizer layout (a config change): never used, never moved; a
    restart meets it again, so `up` stops the run instead."""


class RunRefused(PermanentError, ValueError):
    """The trainer will not start this run as configured (its checkpoints belong to another run, resume is off, its
    acknowledged groups' checkpoints are elsewhere, the JAX job has another size): a restart meets it again."""


class CheckpointUnavailable(RuntimeError):
    """The checkpoint storage kept failing to answer while a checkpoint was read: nothing was moved aside."""


class CheckpointDisagreement(RuntimeError):
    """A process of a multi-process trainer cannot restore the step process 0 chose for all: the job stops."""


class CheckpointAccessDenied(PermanentError):
    """This process may not read the checkpoint storage (files of another user, a read-only mount without read
    rights): says nothing about the checkpoints, so nothing is moved aside, and a restart as the same user meets it
    again."""


class CheckpointSaveFailed(RuntimeError):
    """A checkpoint could not be written (a full disk, a storage that refused the write): its groups stay
    unacknowledged in the buffer, and every later save or look at the saves raises it again."""


class CheckpointDirShared(PermanentError):
    """Another trainer writes checkpoints into this checkpoint.dir (two runs given the same one): its saves would
    replace this run's under the same step numbers."""


class CheckpointDirUnusable(PermanentError, ValueError):
    """checkpoint.dir cannot be created as a directory (a file in the way, no right to create it)."""


class StorageBlip(Exception):
    """A read failed for a reason that passes (see is_transient); the checkpoint may well be sound."""


# errors of the storage, not of the data: local disks rarely give them, network file systems (NFS, gcsfuse) do
TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                              errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ESTALE,
                              errno.EBUSY, errno.ENOLCK, errno.EIO})
# tensorstore (which Orbax reads arrays with) reports absl status codes in its errors' text
_TRANSIENT_STATUS = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|ABORTED)\b")


# this process may not read the files: every checkpoint would fail alike, however sound (tensorstore says it in text)
ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM})
_ACCESS_STATUS = re.compile(r"\bPERMISSION_DENIED\b")


def _in_chain(exc: BaseException | None, says: Callable[[BaseException], bool]) -> bool:
    """Whether `exc` or an error it wraps (up to 10 deep) `says` so."""
    seen = 0
    while exc is not None and seen < 10:
        if says(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def is_transient(exc: BaseException) -> bool:
    """True when `exc`, or an error it wraps, says the storage did not answer rather than that the data is bad."""
    return _in_chain(exc, lambda e: isinstance(e, (TimeoutError, ConnectionError, InterruptedError, BlockingIOError))
                     or (isinstance(e, OSError) and e.errno in TRANSIENT_ERRNOS)
                     or bool(_TRANSIENT_STATUS.search(str(e))))


def access_denied(directory, what: str, exc: BaseException) -> CheckpointAccessDenied:
    """The error for this process not being allowed to read `what` of checkpoint.dir `directory`, with the fix."""
    return CheckpointAccessDenied(
        f"checkpoint.dir {directory}: this process (user id {os.getuid()}) may not read {what} "
        f"({type(exc).__name__}: {str(exc)[:300]}); nothing was moved aside. Give this user read access to the "
        "checkpoint files and write access to checkpoint.dir (or run the trainer as the user that wrote them), then "
        "start the trainer again")


def is_access_denied(exc: BaseException) -> bool:
    """True when `exc`, or an error it wraps, says this process may not read (or move) the files."""
    return _in_chain(exc, lambda e: isinstance(e, PermissionError)
                     or (isinstance(e, OSError) and e.errno in ACCESS_ERRNOS)
                     or bool(_ACCESS_STATUS.search(str(e))))


def base_unreadable(directory, path, exc: BaseException) -> Exception:
    """What a failure to read a LoRA run's frozen base in `path` means: this user may not read it or the storage did
    not answer (neither says anything of the base), else the base is damaged (a restart meets it again: permanent)."""
    if is_access_denied(exc):
        return access_denied(directory, f"the frozen base in {path}", exc)
    if is_transient(exc):
        return CheckpointUnavailable(f"checkpoint.dir {directory}: reading the frozen base in {path} failed because "
                                     f"the storage did not answer ({type(exc).__name__}: {str(exc)[:300]}); check the "
                                     "storage, then start the trainer again")
    return CheckpointMismatch(f"checkpoint.dir {directory}: the frozen base in {path} cannot be read "
                              f"({type(exc).__name__}: {str(exc)[:300]}); restore it from a copy, or start a new run "
                              "with another checkpoint.dir")


def layout_mismatch(directory, step: int, saved: dict | None, now: dict | None) -> str:
    """What CheckpointMismatch says of the checkpoint of `step` holding another model or optimizer layout than this
    run's, naming the settings that differ: `saved`, the layout settings its record keeps (durability.layout_settings),
    `now`, this config's. A checkpoint saved without them (or a change no setting shows) gets the possible causes."""
    saved, now = saved if isinstance(saved, dict) else {}, now or {}
    differ = [key for key in sorted(set(saved) & set(now)) if saved[key] != now[key]]
    where = f"checkpoint.dir {directory}: the checkpoint of step {step} holds a different model or optimizer state"
    if not differ:
        return (
            f"{where} (parameter shapes or dtypes: model.*; model.lora switched on or off; the KL reference: algo.beta "
            "0 or not; trainer.optimizer.schedule constant or not; trainer.optimizer.state_dtype); restore the run's "
            "config or start a new run with another checkpoint.dir")
    shown = lambda value: json.dumps(value, sort_keys=True)  # noqa: E731 - as the config file would spell it
    changes = "; ".join(f"{key} was {shown(saved[key])} when it was saved, {shown(now[key])} in this config"
                        for key in differ)
    fix = ", ".join(f"{key}={shown(saved[key])}" for key in differ)
    return f"{where}: {changes}. Set {fix} to resume it, or start a new run with another checkpoint.dir"


# restores move damaged or digest-less checkpoints aside whole and keep them for inspection: after repeated crashes
# they may be what fills the storage, and nothing else names them
_MAKE_ROOM = ("Make room on that storage (free space: checkpoints set aside there as corrupt-<step>-<time> or "
              "unverified-<step>-<time> can go once inspected; or a lower checkpoint.keep) and check that this user "
              "may write there")


def save_failed(directory, steps: list[int], exc: BaseException) -> CheckpointSaveFailed:
    """The error for the saves of `steps` into checkpoint.dir `directory` failing with `exc`, with the fix."""
    return CheckpointSaveFailed(
        f"checkpoint.dir {directory}: saving the checkpoint{'s' if len(steps) > 1 else ''} of step"
        f"{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} failed "
        f"({type(exc).__name__}: {str(exc)[:300]}); its groups stay unacknowledged in the buffer, so none is lost. "
        f"{_MAKE_ROOM}, then start the trainer again: it resumes from the newest checkpoint")


def digest_failed(directory, step: str, exc: BaseException) -> CheckpointSaveFailed:
    """The error for the digest of the checkpoint of `step` not being written (checkpoint.verify), with the fix."""
    return CheckpointSaveFailed(
        f"checkpoint.dir {directory}: writing the SHA-256 digest of the checkpoint of step {step} (checkpoint.verify) "
        f"failed ({type(exc).__name__}: {str(exc)[:300]}); its groups stay unacknowledged in the buffer, so none is "
        f"lost, and a restart sets that checkpoint aside as unverified. {_MAKE_ROOM}, then start the trainer again")


def base_save_failed(directory, path, exc: BaseException) -> CheckpointSaveFailed:
    """The error for a LoRA run's frozen base not being written to `path`, with the fix."""
    return CheckpointSaveFailed(
        f"checkpoint.dir {directory}: saving the LoRA run's frozen base to {path} failed ({type(exc).__name__}: "
        f"{str(exc)[:300]}); no checkpoint of this run holds its groups yet, so none is lost. {_MAKE_ROOM}, then "
        "start the trainer again: it writes the base again")


def dir_shared(directory, what: str) -> CheckpointDirShared:
    """The error for another trainer's checkpoints (`what`) appearing in checkpoint.dir `directory`."""
    return CheckpointDirShared(
        f"checkpoint.dir {directory}: {what}: another trainer writes into checkpoint.dir (two runs given the same "
        "one, or an older trainer of this run still saving). Nothing more is saved here: stop the other trainer and "
        "give each run its own checkpoint.dir (or --run-dir), then start this one again")


def dir_unusable(directory, exc: BaseException) -> CheckpointDirUnusable:
    return CheckpointDirUnusable(
        f"checkpoint.dir {directory} cannot be used as the checkpoint directory ({type(exc).__name__}: "
        f"{str(exc)[:300]}): point checkpoint.dir at a directory this user may create and write (no file in the way)")
