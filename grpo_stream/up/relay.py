"""A child's output into RUN_DIR/logs/NAME.log and onto `up`'s console, for as long as the child lives.

The relay must never stop reading while its child runs: a child whose pipe nobody drains blocks on its next line
once the pipe's 64 KiB are full, and a blocked trainer or sampler looks hung (the stall watch kills it after
up.*_stall_s, and its restart blocks the same way). So nothing the relay meets ends it:
- a console that went away (a closed terminal, a killed `| tee`): the output goes on into the log alone;
- a log that cannot be written (a full disk, a log directory made read-only): the output goes on to the console,
  `up` says once why, and the lines lost are counted; once the log can be written again, a line there says how many
  are missing;
- bytes that are not UTF-8 (a C library's message, a raw token printed by a reward function): the child's pipe is
  read with errors="replace" (grpo_stream/up/run.py), so they arrive as U+FFFD instead of an exception.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Callable, Iterable, TextIO


class ChildLog:
    """RUN_DIR/logs/NAME.log, appended one line at a time, unbuffered: a line `write` returned from is in the file
    (or counted as lost), never in a buffer that a failed flush would keep failing on."""

    def __init__(self, path: pathlib.Path, name: str, say: Callable[[str], None]):
        self.path, self.name, self.say = path, name, say
        self.lost, self._file = 0, None

    def write(self, line: str) -> None:
        """Append `line`; when the log cannot be written, count it as lost instead (never raises)."""
        missing = f"[up] {self.lost} lines of {self.name}'s output are missing here: {self.path} could not be " \
                  "written\n" if self.lost else ""
        try:
            if self._file is None:
                self._file = open(self.path, "ab", buffering=0)
            self._file.write((missing + line).encode("utf-8", errors="replace"))
        except OSError as exc:
            if not self.lost:
                self.say(f"[up] cannot write {self.path} ({exc.strerror or exc}): {self.name}'s output goes to the "
                         "console only until it can; free space there (or fix its permissions)")
            self.lost += 1
            return
        self.lost = 0

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def relay(lines: Iterable[str], log: ChildLog, prefix: str, console: TextIO | None = None) -> None:
    """Every line of `lines` (a child's output, until it closes) into `log` and, as `[prefix] line`, onto `console`
    (default: sys.stdout) while the console takes it."""
    out = console or sys.stdout
    try:
        for line in lines:
            log.write(line)
            if out is not None:
                try:
                    out.write(f"[{prefix}] {line}")
                    out.flush()
                except (OSError, ValueError):
                    out = None
    finally:
        log.close()
