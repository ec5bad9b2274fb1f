"""Progress beats: a process touches RUN_DIR/heartbeats/NAME whenever it makes progress, and a supervisor (`up`)
reads the file's age to tell a job that works slowly from one that hangs (a collective waiting for a process that
will never join, a deadlock). A file's mtime, not a socket: it survives the supervisor's restarts, costs one
syscall per beat, and a reader needs nothing but the run directory."""

from __future__ import annotations

import os
import pathlib
import time

HEARTBEATS_DIR = "heartbeats"


def beat_path(run_dir: pathlib.Path | str, name: str) -> pathlib.Path:
    return pathlib.Path(run_dir) / HEARTBEATS_DIR / name


def beat(run_dir: pathlib.Path | str | None, name: str) -> None:
    """Record that process `name` made progress now; never raises (a full disk must not stop training)."""
    if run_dir is None:
        return
    path = beat_path(run_dir, name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # creates it, or sets its mtime to now; never through a link planted at its name (which would touch, or
        # create, the file it names)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.utime(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def seconds_since_beat(run_dir: pathlib.Path | str, name: str, now: float | None = None) -> float | None:
    """Seconds since `name` last beat, or None when it never did (in this run directory)."""
    try:
        mtime = beat_path(run_dir, name).stat().st_mtime
    except OSError:
        return None
    return max(0.0, (time.time() if now is None else now) - mtime)


class Heartbeat:
    """`beat(run_dir, name)` as a callable for long loops (a warm start's steps, an evaluation's batches), at most
    once every `every_s` seconds; `now()` beats whatever the interval."""

    def __init__(self, run_dir: pathlib.Path | str | None, name: str, every_s: float = 5.0):
        self.run_dir, self.name, self.every_s = run_dir, name, every_s
        self._last = float("-inf")

    def __call__(self) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self.now()

    def now(self) -> None:
        beat(self.run_dir, self.name)
        self._last = time.monotonic()

