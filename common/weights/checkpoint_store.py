"""The `checkpoint` weight transport: Orbax versions in a shared directory with atomic completion.

Layout under `weights.checkpoint_dir` (local disk, NFS or gs://):

    v0000000012-<epoch>/          Orbax checkpoint of version 12 (each trainer device writes its shards)
    v0000000012-<epoch>/COMPLETE  JSON {version, final, epoch, published_unix, tensors}, written after Orbax
                                  has finished: a directory without it is never read
    LATEST                        JSON of the newest complete version, replaced atomically (write + rename)
    base-<epoch>/                 LoRA: the frozen base weights of a trainer epoch, which its adapters-only
                                  versions name in their manifests; replaced by the next epoch's

Samplers read LATEST (a few hundred bytes) to poll and restore straight into
their own sharding; they never see a partly written version. The trainer
keeps the newest `keep` versions; a sampler whose version was deleted while
it restored gets an error and retries with the newest.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import re
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from google.protobuf.message import DecodeError

from grpo_stream.common.runtime.errors import TransientError
from grpo_stream.common.weights.snapshot import BASE_VERSION
from grpo_stream.common.weights.transport import WeightsMismatch
from grpo_stream.protos import weights_pb2

log = logging.getLogger(__name__)
MARKER, LATEST = "COMPLETE", "LATEST"


def _entry(name: str) -> tuple[str | None, str]:
    """What an entry of the store's root named `name` is, as the store names what it writes, and the trainer epoch
    that wrote it: "version" (v<version>-<epoch>), "base" (base-<epoch>), "partial" (Orbax's temporary directory of
    either) or "tmp" (LATEST.<epoch>.tmp); (None, "") for anything else, which the store never deletes:
    weights.checkpoint_dir may be a directory (or a bucket) that holds other files."""
    m = re.fullmatch(r"(v\d{10,}|base)-([^.]+)(\..*orbax-checkpoint-tmp.*)?", name)
    if m is not None:
        return ("partial" if m[3] else "base" if m[1] == "base" else "version"), m[2]
    m = re.fullmatch(rf"{LATEST}\.([^.]+)\.tmp", name)
    return ("tmp", m[1]) if m is not None else (None, "")


def _key(name: str) -> str:
    """Orbax uses tree keys as storage paths: parameter names become dot-free keys."""
    return name.replace(".", "__")


class CheckpointError(TransientError):
    """A version directory that is missing or incomplete (deleted by the trainer's pruning while a sampler read it,
    LATEST rewritten meanwhile): the sampler polls LATEST again. A version that does not fit the model raises
    WeightsMismatch instead (permanent)."""


_RECORD_FIELDS = {"version": int, "final": bool, "epoch": str, "published_unix": (int, float), "location": str,
                  "tensors": list}
_JSON_KIND = {"version": "a whole number", "final": "true or false", "epoch": "a string", "published_unix": "a number",
              "location": "a string", "tensors": "a list"}


def record_problem(record) -> str | None:
    """What makes `record` (a parsed LATEST) unusable as a version's record, naming the field; None when usable. A
    sampler builds a manifest from it, so a damaged one must not surface as a KeyError that stops the sampler."""
    if not isinstance(record, dict):
        return f"JSON {json.dumps(record)[:40]}, not an object"
    for field, kind in _RECORD_FIELDS.items():
        if field not in record:
            return f"no {field}"
        value = record[field]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"{field}: {json.dumps(value)[:40]} is not {_JSON_KIND[field]}"
    if not isinstance(record.get("adapters", ""), str):
        return "adapters: not a string"
    problem = _value_problem(record)
    if problem is not None:
        return problem
    total = 0  # the manifest's total_bytes (int64): shapes past it failed the manifest's build, a permanent error
    for i, entry in enumerate(record["tensors"]):
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], list) and all(type(n) is int and 0 <= n < 1 << 62 for n in entry[1])
                and isinstance(entry[2], str)):
            return f"tensors[{i}]: {str(entry)[:60]!r} is not [name, shape, dtype]"
        if not _utf8(entry[0]):
            return f"tensors[{i}]: name not UTF-8 text"
        try:
            total += math.prod(entry[1]) * np.dtype(entry[2]).itemsize
        except (TypeError, ValueError):
            return f"tensors[{i}]: unknown dtype {entry[2][:40]!r}"
    if total >= 1 << 63:
        return f"tensors: {total} bytes in all, more than any version holds"
    if record.get("adapters"):
        try:
            weights_pb2.AdapterVersion.FromString(base64.b64decode(record["adapters"], validate=True))
        except (ValueError, DecodeError):  # binascii.Error is a ValueError
            return f"adapters: {record['adapters'][:40]!r} is not a base64 AdapterVersion"
    return None


def _utf8(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (JSON may hold lone surrogates, "\\ud800", that no proto string takes)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _value_problem(record: dict) -> str | None:
    """What in a record of the right JSON kinds no manifest can hold (its build raised ValueError, OverflowError or
    UnicodeEncodeError, which stopped the sampler), naming the field; None when nothing."""
    if not 0 <= record["version"] < 1 << 63:  # int64; the store writes versions from 0 (LoRA's base never here)
        return f"version: {record['version']} is not a version number (0 up to 2^63 - 1)"
    try:
        float(record["published_unix"])
    except OverflowError:
        return f"published_unix: {str(record['published_unix'])[:40]} is past any time a double holds"
    for field in ("epoch", "location", "adapters"):
        if not _utf8(record.get(field, "")):
            return f"{field}: not UTF-8 text"
    return None


class CheckpointWeightStore:
    def __init__(self, root: str, keep: int = 3):
        self.root = epath.Path(root)
        self.keep = keep
        self._checkpointer = ocp.StandardCheckpointer()

    # -- trainer side ---------------------------------------------------------------------------------------
    def save(self, version: int, named: dict[str, jax.Array], final: bool, epoch: str,
             extra: dict | None = None) -> dict:
        """Write `named` (device arrays, any sharding) as `version`; return its COMPLETE record (with `extra`'s
        JSON fields: LoRA's merge)."""
        self.root.mkdir(parents=True, exist_ok=True)
        base = version == BASE_VERSION  # LoRA's frozen base: beside the versions, never LATEST, never pruned by them
        path = self.root / (f"base-{epoch}" if base else f"v{version:010d}-{epoch}")
        if (path / MARKER).exists():  # the final re-publication of an already saved version (a resumed, ended run)
            record = json.loads((path / MARKER).read_text())
            if final and not record.get("final") and not base:  # samplers read `final` from LATEST: say it there
                record.update(final=True, published_unix=time.time())
                self._write_atomic(path / MARKER, record, epoch)
                self._write_atomic(self.root / LATEST, record, epoch)
            return record
        self._checkpointer.save(path, {_key(n): a for n, a in named.items()}, force=True)
        self._checkpointer.wait_until_finished()
        record = {"version": version, "final": final, "epoch": epoch, "published_unix": time.time(),
                  "location": str(path),
                  "tensors": [[n, list(a.shape), np.dtype(a.dtype).name] for n, a in named.items()], **(extra or {})}
        (path / MARKER).write_text(json.dumps(record))
        if base:  # the bases of earlier trainer processes: their samplers follow this epoch now
            for old in self.root.iterdir():  # a base-* directory of the user's (no marker, no Orbax metadata) stays
                if _entry(old.name)[0] == "base" and old != path and (
                        (old / MARKER).exists() or (old / "_CHECKPOINT_METADATA").exists()):
                    self._remove(old)
            return record
        self._write_atomic(self.root / LATEST, record, epoch)
        self._prune(path, epoch)
        return record

    def _write_atomic(self, path: epath.Path, record: dict, epoch: str) -> None:
        tmp = path.parent / f"{path.name}.{epoch}.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(path)  # atomic on POSIX; on object stores a copy, read whole or not at all

    def _prune(self, newest: epath.Path, epoch: str) -> None:
        """Keep the newest `keep` complete versions by publication time, not by number: a resumed trainer publishes
        below the numbers its dead predecessor reached, whose directories would otherwise hold the newest places
        and each new version would delete the one before it. Also drop what an earlier trainer process left half
        written (a version without its marker, a temporary file): no reader ever takes those."""
        complete, leftovers = [], []
        for p in self.root.iterdir():
            kind, owner = _entry(p.name)
            if kind == "version" and (p / MARKER).exists():
                complete.append(p)
            elif kind in ("version", "partial", "tmp") and owner != epoch:
                leftovers.append(p)  # an earlier process's unfinished version (or Orbax's temporary directory of it)
        complete.sort(key=lambda p: (p == newest, self._published(p), p.name))
        for old in complete[: max(0, len(complete) - self.keep)] + leftovers:
            self._remove(old)

    @staticmethod
    def _published(version_dir: epath.Path) -> float:
        try:
            return float(json.loads((version_dir / MARKER).read_text())["published_unix"])
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: the oldest, the first to go
            return 0.0

    @staticmethod
    def _remove(old: epath.Path) -> None:
        try:
            if old.is_dir():  # the marker first: a sampler restoring it meanwhile then sees why its read failed
                (old / MARKER).unlink(missing_ok=True)
                old.rmtree()
            else:
                old.unlink()
        except OSError as exc:  # another process may be reading it; the next publish retries
            log.warning("could not delete old weight version %s: %s", old, exc)

    # -- sampler side ---------------------------------------------------------------------------------------
    def latest(self) -> dict | None:
        """The newest complete version's record, or None when nothing is published yet."""
        path = self.root / LATEST
        if not path.exists():
            return None
        try:  # damaged: bytes that are not UTF-8 (UnicodeDecodeError) or not JSON, or nested past the parser
            record = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{path}: unreadable ({exc}); the trainer rewrites it at its next publish")
        problem = record_problem(record)
        if problem is not None:  # damaged, or written by something else: the sampler keeps its version and polls
            raise CheckpointError(f"{path}: not a weight version's record ({problem}); the trainer rewrites it at "
                                  "its next publish; is weights.checkpoint_dir shared with something else?")
        return record

    def version_dir(self, location: str) -> epath.Path:
        """The directory that a record's `location` (the trainer's path of it) names, in this store's root: a sampler
        that mounts the shared directory at another path than the trainer (its own weights.checkpoint_dir) finds it
        there, and a record never sends a sampler to read outside weights.checkpoint_dir."""
        name = epath.Path(location).name if location else ""
        if _entry(name)[0] not in ("version", "base"):
            raise CheckpointError(f"location: {location[:200]!r} names no version directory of {self.root}; the "
                                  "trainer rewrites LATEST at its next publish")
        return self.root / name

    def restore(self, record: dict, targets: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
        """Version `record` restored into `targets` (name -> ShapeDtypeStruct with sharding and dtype)."""
        path = self.version_dir(record["location"])
        if not (path / MARKER).exists():
            raise CheckpointError(f"{path}: no {MARKER} marker (deleted or never finished); poll LATEST again")
        stored = {n: (tuple(s), d) for n, s, d in record["tensors"]}
        missing = sorted(set(targets) - set(stored))
        extra = sorted(set(stored) - set(targets))
        if missing or extra:
            raise WeightsMismatch(f"{path}: parameter names differ from the model (missing {missing[:3]}, "
                                  f"unexpected {extra[:3]}); is weights.checkpoint_dir shared with another run?")
        for name, target in targets.items():
            if tuple(target.shape) != stored[name][0]:
                raise WeightsMismatch(f"{path}: {name} is {stored[name][0]} there and {tuple(target.shape)} here; "
                                      "start the sampler with the trainer's model settings")
        try:
            restored = self._checkpointer.restore(path, {_key(n): t for n, t in targets.items()})
        except Exception as exc:  # noqa: BLE001 - TensorStore raises bare Exception for a data file deleted mid-read
            # pruned by the trainer while read (its marker goes first), or a read that failed: poll LATEST again
            if isinstance(exc, (FileNotFoundError, ValueError, OSError)) or not (path / MARKER).exists():
                raise CheckpointError(f"{path}: restore failed ({exc.__class__.__name__}: {str(exc)[:300]}); "
                                      "poll LATEST again") from exc
            raise
        return {name: restored[_key(name)] for name in targets}
