"""How the run's JSON and report files are written: strict JSON, whole or not at all.

- `to_json`: a float that is not finite (a NaN loss, an infinite ratio) is written as null. Python's json writes
  bare NaN / Infinity, which no strict JSON reader (jq, JavaScript, Go, pandas with the standard parser) accepts;
  allow_nan=False makes any value missed here an error instead of an invalid file.
- `write_atomic`: the text goes to a temporary file in the same directory, synced to disk, then os.replace puts it
  in place, so a reader (or a kill mid-write, or a host crash) never sees half a file. The trainer's summary.json,
  the samplers' sampler-<i>.json, `report`'s files, `audit`'s report and `up`'s endpoints.json and summary.json all
  use it.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import tempfile

import numpy as np


_UMASK = os.umask(0o022)  # read once, at import (os.umask can only be read by setting it)
os.umask(_UMASK)


def finite(value):
    """`value` with every non-finite float (also inside dicts, lists and tuples) replaced by None, and numpy scalars
    and arrays as the Python numbers and lists they hold (json refuses float32, int64, bool_ and arrays)."""
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def to_json(value, **kwargs) -> str:
    """json.dumps of `value` with non-finite floats as null and numpy numbers as Python's (module doc)."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def write_atomic(path: pathlib.Path, text: str | bytes, private: bool = False) -> None:
    """Write `text` (or bytes; text as UTF-8, whatever the locale) to `path` whole (module doc); the temporary file
    is removed when writing fails. `private`: readable by this user only (a file that may hold secrets)."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as file:
            if not private:
                os.fchmod(fd, 0o666 & ~_UMASK)  # as open() would make it: mkstemp's 0600 would hide it from others
            file.write(text if isinstance(text, bytes) else text.encode("utf-8"))
            file.flush()
            os.fsync(file.fileno())  # the bytes on disk before the name points at them (a crash: old file or new)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    _sync_directory(path.parent)


def _sync_directory(directory: pathlib.Path) -> None:
    """The rename on disk too; where a directory cannot be synced (some network filesystems), as it is."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
