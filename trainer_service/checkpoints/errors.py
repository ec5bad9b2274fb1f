"""What a checkpoint restore can conclude, as exceptions, and which read failures are the storage's rather than
the checkpoint's (store.py retries those and never moves a checkpoint aside for them)."""

from __future__ import annotations

import errno
import re

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


class StorageBlip(Exception):
    """A read failed for a reason that passes (see is_transient); the checkpoint may well be sound."""


# errors of the storage, not of the data: local disks rarely give them, network file systems (NFS, gcsfuse) do
TRANSIENT_ERRNOS = frozenset({errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                              errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ESTALE,
                              errno.EBUSY, errno.ENOLCK, errno.EIO})
# tensorstore (which Orbax reads arrays with) reports absl status codes in its errors' text
_TRANSIENT_STATUS = re.compile(r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED|ABORTED)\b")


def is_transient(exc: BaseException) -> bool:
    """True when `exc`, or an error it wraps, says the storage did not answer rather than that the data is bad."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, (TimeoutError, ConnectionError, InterruptedError, BlockingIOError)):
            return True
        if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
            return True
        if _TRANSIENT_STATUS.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False
