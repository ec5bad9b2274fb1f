"""argparse types the commands share (the run's processes and tools in cli.py, the prompt client's in
client/submit.py): each refuses a value that would be taken and fail later, or worse, without naming the argument."""

from __future__ import annotations

import argparse
import os
import pathlib

from grpo_stream.common.runtime.errors import SetupError


def int_from(low: int):
    """An argparse type: an int of at least `low` (a negative --gpus or --index was taken, and planned or failed
    later with a message that did not name the argument)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


positive_int, nonnegative_int = int_from(1), int_from(0)


def nonempty_path(text: str) -> pathlib.Path:
    """An argparse type: a path that is not empty. pathlib reads '' as '.': `up --run-dir "$RUN_DIR"` with the
    variable unset ran the whole run in the current directory (a source tree), writing its Redis, checkpoints and
    logs among the user's files."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give a directory or file name, "
                                         "or '.' for the current directory")
    return pathlib.Path(text)


def run_dir_path(text: str) -> pathlib.Path:
    """An argparse type: a run directory a process writes (`nonempty_path`), refused when a file stands where it or
    a folder above it would be: that was a failure a restart may fix (exit 1), "File exists", after the config
    loaded."""
    path = nonempty_path(text)
    for place in (path, *path.parents):
        if place.exists() or place.is_symlink():
            if not place.is_dir():
                what = "is" if place == path else f"lies under {place}, which is"
                raise argparse.ArgumentTypeError(f"{path} {what} a file, not a directory; give a directory (made if "
                                                 "new)")
            break
    return path


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0 or value == float("inf"):  # also NaN
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def check_json_path(json_path: pathlib.Path) -> None:
    """Refuse a --json that cannot take the result before the evaluation runs (it made the whole evaluation, then
    failed to write it: a directory, a file where its folder should be, a folder that cannot be written)."""
    if json_path.is_dir():
        raise SetupError(f"--json {json_path}: is a directory; name a file, e.g. {json_path / 'eval.json'}")
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SetupError(f"--json {json_path}: its folder cannot be made ({exc}); name a file in a writable "
                         "folder") from exc
    if not os.access(json_path.parent, os.W_OK | os.X_OK):
        raise SetupError(f"--json {json_path}: {json_path.parent} is not writable; name a file in a writable folder")
