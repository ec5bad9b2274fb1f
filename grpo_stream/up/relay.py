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
Nor may a console that is not read stop the run (`up | less` paused, Ctrl-S in a terminal): the console is written
by a thread of its own through a bounded queue (QueuedConsole); while it blocks, lines it cannot take are counted,
not waited for, and said once it reads again. The logs have every line.
Nor may a child's output fill `up`'s memory or its disk: a line is read LINE_CHARS characters at a time (a reward
function that prints a gigabyte without a newline is relayed in pieces), and a log past logging.file_max_mb is
rotated, NAME.log.1 to NAME.log.<logging.file_keep>, the oldest dropped (logrotate's `size` and `rotate`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import queue
import sys
import threading
import time
from typing import Callable, Iterable, Iterator, TextIO

# a long line arrives in pieces of this many characters; each piece is a line of its own on the console
LINE_CHARS = 1 << 16


@dataclasses.dataclass(frozen=True)
class LogLimits:
    """logging.file_max_mb and logging.file_keep, in bytes and files."""

    max_bytes: int = 256 << 20
    keep: int = 4

    @classmethod
    def of(cls, logging_section) -> "LogLimits":
        return cls(int(logging_section.file_max_mb * (1 << 20)), logging_section.file_keep)


class QueuedConsole:
    """`up`'s stdout, written by a thread of its own: write() never blocks. At most `capacity` lines and
    `capacity_chars` characters wait (10,000 pieces of a long line held 2.5 GiB of emoji); past that they are dropped
    and counted, and the count is said once the console reads again. A console that fails (a closed terminal, a
    reader gone) takes nothing more."""

    def __init__(self, capacity: int = 10_000, capacity_chars: int = 8 << 20):
        self._lines: queue.Queue[str] = queue.Queue(maxsize=capacity)
        self._lock, self._thread, self._dropped, self._gone = threading.Lock(), None, 0, False
        self._chars, self._capacity_chars = 0, capacity_chars

    def write(self, text: str) -> None:
        if self._gone:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_out, name="up-console", daemon=True)
                self._thread.start()
            try:
                if self._chars + len(text) > self._capacity_chars:
                    raise queue.Full
                self._lines.put_nowait(text)
                self._chars += len(text)
            except queue.Full:
                self._dropped += 1

    def flush(self) -> None:
        """Nothing to do: the console's thread flushes after every line."""

    def drain(self, timeout_s: float = 5.0) -> None:
        """Wait up to `timeout_s` for the lines waiting to reach the console (before `up`'s last lines)."""
        deadline = time.monotonic() + timeout_s
        while not self._gone and self._lines.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_out(self) -> None:
        while True:
            text = self._lines.get()
            try:
                with self._lock:
                    dropped, self._dropped = self._dropped, 0
                    self._chars -= len(text)
                if dropped:
                    sys.stdout.write(f"[up] {dropped} lines were not shown here while this console was not read; "
                                     "RUN_DIR/logs/ has them all\n")
                sys.stdout.write(text)
                sys.stdout.flush()
            except (OSError, ValueError):
                self._gone = True
                mute(sys.stdout)
            finally:
                self._lines.task_done()


def say_now(text: str, stream: TextIO | None = None) -> None:
    """`text` and a newline on `stream` (default: sys.stdout; `up`'s own lines before and after its processes run),
    or nowhere once its reader is gone (`up | head`, a killed `| tee`, a closed terminal): a console that went away
    must not turn a finished run into a failed one."""
    out = stream or sys.stdout
    try:
        out.write(text + "\n")
        out.flush()
    except (OSError, ValueError):
        mute(out)


def mute(stream: TextIO) -> None:
    """Point `stream`'s descriptor at /dev/null once its reader is gone: what its buffer still holds, and the
    interpreter's own flush at exit, then go nowhere instead of failing again (a failed flush at exit makes Python
    print a traceback and exit 120, whatever `up` returned)."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, stream.fileno())
        finally:
            os.close(null)
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's stream): nothing buffered at exit
        pass


def bounded_lines(stream: TextIO) -> Iterator[str]:
    """The lines of `stream` until it closes, none longer than LINE_CHARS characters (a longer one in pieces)."""
    return iter(lambda: stream.readline(LINE_CHARS), "")


def rotate(path: pathlib.Path, keep: int) -> None:
    """Move `path` aside as path.1, path.1 as path.2, ... up to path.<keep>; the oldest is dropped (keep 0: `path`
    itself is). Best effort: a file that cannot be moved stays, and the log goes on growing rather than stop."""
    try:
        for k in range(keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{k}")
            if older.exists():
                older.replace(path.with_name(f"{path.name}.{k + 1}"))
        if keep:
            path.replace(path.with_name(f"{path.name}.1"))
        else:
            path.unlink()
    except OSError:
        pass


class ChildLog:
    """RUN_DIR/logs/NAME.log, appended one line at a time, unbuffered: a line `write` returned from is in the file
    (or counted as lost), never in a buffer that a failed flush would keep failing on. Once the file holds
    `max_bytes` it is rotated (rotate()) and a new one started."""

    def __init__(self, path: pathlib.Path, name: str, say: Callable[[str], None], limits: LogLimits = LogLimits()):
        self.path, self.name, self.say, self.limits = path, name, say, limits
        self.lost, self._file, self._size = 0, None, 0

    def write(self, line: str) -> None:
        """Append `line`; when the log cannot be written, count it as lost instead (never raises)."""
        missing = f"[up] {self.lost} lines of {self.name}'s output are missing here: {self.path} could not be " \
                  "written\n" if self.lost else ""
        try:
            if self._file is None:
                self._file = open(self.path, "ab", buffering=0)
                self._size = self._file.tell()
            data = (missing + line).encode("utf-8", errors="replace")
            self._file.write(data)
            self._size += len(data)
        except OSError as exc:
            if not self.lost:
                self.say(f"[up] cannot write {self.path} ({exc.strerror or exc}): {self.name}'s output goes to the "
                         "console only until it can; free space there (or fix its permissions)")
            self.lost += 1
            return
        self.lost = 0
        if self._size >= self.limits.max_bytes:
            self.close()
            rotate(self.path, self.limits.keep)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def relay(lines: Iterable[str], log: ChildLog, prefix: str, console: TextIO | None = None) -> None:
    """Every line of `lines` (a child's output, until it closes: bounded_lines()) into `log` as it came and, as
    `[prefix] line`, onto `console` (default: sys.stdout) while the console takes it, a piece of a long line ended
    there with a newline."""
    out = console or sys.stdout
    try:
        for line in lines:
            log.write(line)
            if out is not None:
                try:
                    out.write(f"[{prefix}] {line}" if line.endswith("\n") else f"[{prefix}] {line}\n")
                    out.flush()
                except (OSError, ValueError):
                    out = None
    finally:
        log.close()
