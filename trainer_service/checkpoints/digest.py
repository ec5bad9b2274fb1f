"""SHA-256s of a committed checkpoint's files, written beside them off the step's path and checked before a restore.

With checkpoint.verify a checkpoint's files get their SHA-256s in `<step>/sha256.json` once Orbax has committed
the save. Hashing the files, not the arrays, keeps the step loop and the devices out of it: no second copy of the
parameters and optimizer state off the devices (the update donates them, so a copy read later could find them
gone), no collective on a thread of a multi-process trainer (gathering a sharded array is one, and would interleave
with the step's), and it checks the very bytes a restore reads. `DigestWriter` hashes on one background thread
while the trainer keeps stepping.

A restore checks every listed file before reading any array. A file that differs or is gone rejects the checkpoint.
A checkpoint whose digest file is missing (the process died between Orbax's commit and the digest) or cut off is
unverified; trainer_service/checkpoints/store.py sets it aside like a damaged one.

`tree_digest` and `tree_layout` hash arrays themselves: what a LoRA run's frozen base is checked against, and the
layout (paths, shapes, dtypes) a restore must match.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
from typing import Any, Callable, Iterator

import jax
import numpy as np
from etils import epath

from grpo_stream.common.model.sharding import host_copy
from grpo_stream.common.weights.snapshot import raw_bytes
from grpo_stream.trainer_service.checkpoints.errors import digest_failed

DIGEST_FILE = "sha256.json"
_PIECE = 16 << 20  # bytes hashed per read: bounded host memory whatever the checkpoint's size


class DigestMissing(Exception):
    """The checkpoint has no (complete) digest file."""


def _files(root: epath.Path, under: epath.Path) -> Iterator[epath.Path]:
    for path in sorted(under.iterdir(), key=lambda p: p.name):
        if path.is_dir():
            yield from _files(root, path)
        elif not (under == root and path.name.startswith(DIGEST_FILE)):  # the digest and its temporary file
            yield path


def _sha256(path: epath.Path, progress: Callable[[], None] | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(_PIECE):
            h.update(piece)
            if progress is not None:
                progress()
    return h.hexdigest()


def files_digest(step_dir: epath.Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file of the checkpoint in `step_dir` (but the digest file)."""
    return {str(p.relative_to(step_dir)): _sha256(p) for p in _files(step_dir, step_dir)}


def write_digest(step_dir: epath.Path) -> None:
    """Hash `step_dir`'s files and write the digest file beside them; the write is atomic (a process killed while
    writing leaves no digest file, which a restore treats as a missing digest)."""
    record = {"sha256": files_digest(step_dir)}
    tmp = step_dir / f"{DIGEST_FILE}.tmp"
    try:
        tmp.write_text(json.dumps(record, indent=0, sort_keys=True))
        tmp.rename(step_dir / DIGEST_FILE)
    except BaseException:
        with contextlib.suppress(OSError):  # a cut-off temporary file (a full disk) only takes space: best effort
            tmp.unlink(missing_ok=True)
        raise


def check_digest(step_dir: epath.Path, progress: Callable[[], None] | None = None) -> str | None:
    """None when every file the digest lists is there with its SHA-256; else what differs. Raises DigestMissing when
    there is no complete digest file. Files added since (an NFS `.nfs*` leftover) are not the checkpoint's: ignored.
    `progress`: called as the files are read (a trainer's heartbeat: hashing a large model's checkpoint, a TB at
    full size, takes longer than up.trainer_stall_s, and `up` restarted the trainer into the same check again)."""
    path = step_dir / DIGEST_FILE
    if not path.exists():
        raise DigestMissing(f"no {DIGEST_FILE}")
    try:
        listed = json.loads(path.read_text())["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise DigestMissing(f"{DIGEST_FILE} is incomplete ({type(exc).__name__})") from exc
    for name, expected in sorted(listed.items()):
        file = step_dir / name
        if not file.exists():
            return f"its file {name} is gone"
        if _sha256(file, progress) != expected:
            return f"its file {name} does not match the SHA-256 saved with it"
    return None


class DigestWriter:
    """Writes digest files on one background thread, in the order asked."""

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-digest")

    def submit(self, step_dir: epath.Path) -> concurrent.futures.Future:
        """The future of `step_dir`'s digest; it raises CheckpointSaveFailed (naming the step and the fix) when the
        digest cannot be written, e.g. on a disk the checkpoint just filled."""
        return self._pool.submit(_write_or_explain, step_dir)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _write_or_explain(step_dir: epath.Path) -> None:
    try:
        write_digest(step_dir)
    except Exception as exc:  # noqa: BLE001 - a bare OSError named neither the checkpoint nor the fix
        raise digest_failed(step_dir.parent, step_dir.name, exc) from exc


def tree_digest(tree: Any) -> str:
    """SHA-256 over every leaf's path, dtype, shape and bytes (gathered to the host)."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        arr = np.ascontiguousarray(host_copy(leaf))  # gathered on a multi-process trainer (every process calls)
        h.update(f"{jax.tree_util.keystr(path)}:{arr.dtype.name}:{list(arr.shape)};".encode())
        h.update(raw_bytes(arr))
    return h.hexdigest()


def tree_layout(tree: Any) -> str:
    """SHA-256 of every leaf's path, shape and dtype (arrays or ShapeDtypeStructs): what a restore must match."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        h.update(f"{jax.tree_util.keystr(path)}:{np.dtype(leaf.dtype).name}:{list(leaf.shape)};".encode())
    return h.hexdigest()
