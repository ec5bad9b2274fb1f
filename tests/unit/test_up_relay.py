"""The relay of a child's output (grpo_stream/up/relay.py): it keeps draining the child's pipe whatever it meets (a
log on a full disk, bytes that are not UTF-8), so a child of `up` never blocks on a full pipe and looks hung; and
what it could not keep in the log is said there once the log can be written again. Nor can a child's output fill
`up`'s memory (a line without end) or the disk (a log without end). Real child processes."""

from __future__ import annotations

import errno
import os
import sys
import threading

import pytest

from grpo_stream.up.processes import ProcessSpec
from grpo_stream.up import run as up_run
from grpo_stream.up.relay import LINE_CHARS, ChildLog, LogLimits, QueuedConsole
from grpo_stream.up.run import _Child

TALKER = "for i in range(20000):\n    print('x' * 20, i)"  # 500 KB: eight times what a pipe holds


class Console:
    """`up`'s stdout, kept."""

    def __init__(self):
        self.text = []

    def write(self, text):
        self.text.append(text)

    def flush(self):
        pass


@pytest.fixture(autouse=True)
def _a_console_of_its_own(monkeypatch):
    """`up`'s console is one per process, and one whose writes failed once takes nothing more: a test in this worker
    that left it so (a captured stdout closed under it) made every later test here read an empty console."""
    monkeypatch.setattr(up_run, "CONSOLE", QueuedConsole())


def talker(tmp_path, code: str, limits: LogLimits = LogLimits()) -> _Child:
    (tmp_path / "logs").mkdir(exist_ok=True)
    return _Child(ProcessSpec("sampler-0", (sys.executable, "-c", code), dict(os.environ), "sampler", "sampler-0"),
                  tmp_path / "logs", limits)


def run_to_end(child: _Child) -> int:
    child.start()
    try:
        return child.proc.wait(timeout=60)  # before the fix: blocked on its full pipe, for ever
    finally:
        child.kill()
        child._relay.join(timeout=10)
        up_run.CONSOLE.drain()


def test_a_child_whose_log_cannot_be_written_runs_to_its_end_and_its_output_still_reaches_the_console(
        tmp_path, monkeypatch):
    """A full disk ended the relay at its first failed write: the trainer then blocked on its next log line."""
    console = Console()
    monkeypatch.setattr(sys, "stdout", console)
    child = talker(tmp_path, TALKER)
    child.log_path.symlink_to("/dev/full")  # every write: ENOSPC, as on a full disk
    child.starts = 1  # a restart: its log goes on (a first start would move it aside as sampler-0.log.1)
    assert run_to_end(child) == 0
    text = "".join(console.text)
    assert "[sampler-0] " + "x" * 20 + " 19999\n" in text
    assert text.count(f"[up] cannot write {child.log_path} (No space left on device): sampler-0's output goes to "
                      "the console only") == 1


def test_bytes_that_are_not_utf8_do_not_end_the_relay(tmp_path, monkeypatch):
    """A raw token or a C library's message in another encoding raised UnicodeDecodeError in the relay."""
    monkeypatch.setattr(sys, "stdout", Console())
    child = talker(tmp_path, "import sys\nsys.stdout.buffer.write(b'token \\xff\\xfe\\n'); sys.stdout.flush()\n"
                   + TALKER)
    assert run_to_end(child) == 0
    lines = (tmp_path / "logs" / "sampler-0.log").read_text().splitlines()
    assert lines[0] == "token \ufffd\ufffd" and len(lines) == 20001 and lines[-1] == "x" * 20 + " 19999"


class FillingDisk:
    """A log file on a disk that is full for the first `full` writes, then has room again."""

    def __init__(self, path, full: int):
        self.path, self.full = path, full

    def write(self, data: bytes) -> int:
        if self.full:
            self.full -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        with open(self.path, "ab") as f:
            return f.write(data)

    def close(self):
        pass


def test_lines_lost_to_a_full_disk_are_counted_in_the_log_once_it_can_be_written(tmp_path):
    said = []
    log = ChildLog(tmp_path / "trainer.log", "trainer", said.append)
    log._file = FillingDisk(tmp_path / "trainer.log", full=3)
    for k in range(5):
        log.write(f"step {k}\n")
    assert (tmp_path / "trainer.log").read_text().splitlines() == [
        f"[up] 3 lines of trainer's output are missing here: {tmp_path / 'trainer.log'} could not be written",
        "step 3", "step 4"]
    assert len(said) == 1 and said[0].startswith(f"[up] cannot write {tmp_path / 'trainer.log'} (No space left")


def test_a_line_without_end_is_relayed_in_pieces_and_kept_whole_in_the_log(tmp_path, monkeypatch):
    """A reward function that prints 3 MB without a newline: the relay read the whole line into `up`'s memory before
    it wrote any of it (a gigabyte of them would end `up`)."""
    console = Console()
    monkeypatch.setattr(sys, "stdout", console)
    child = talker(tmp_path, "import sys\nsys.stdout.write('y' * 3_000_000); sys.stdout.flush()\nprint(); print('end')")
    assert run_to_end(child) == 0
    pieces = "".join(console.text).splitlines()
    assert max(len(piece) for piece in pieces) <= len("[sampler-0] ") + LINE_CHARS
    assert sum(piece.count("y") for piece in pieces) == 3_000_000 and pieces[-1] == "[sampler-0] end"
    assert (tmp_path / "logs" / "sampler-0.log").read_text() == "y" * 3_000_000 + "\nend\n"


def test_a_log_past_its_size_is_rotated_and_the_oldest_dropped(tmp_path):
    log = ChildLog(tmp_path / "trainer.log", "trainer", print, LogLimits(max_bytes=1000, keep=2))
    for k in range(90):
        log.write(f"step {k:04d} " + "." * 39 + "\n")  # 50 bytes a line: a new file every 20 lines
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["trainer.log", "trainer.log.1", "trainer.log.2"]  # the 2 newest kept
    kept = [(tmp_path / name).read_text().splitlines() for name in ("trainer.log.2", "trainer.log.1", "trainer.log")]
    assert [len(lines) for lines in kept] == [20, 20, 10] and kept[0][0].startswith("step 0040 ")
    assert kept[2][-1].startswith("step 0089 ")


def test_an_earlier_ups_log_is_rotated_with_the_rest(tmp_path, monkeypatch):
    """The log of an earlier `up` went to NAME.log.1 and overwrote the one before it."""
    monkeypatch.setattr(sys, "stdout", Console())
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "sampler-0.log").write_text("second up\n")
    (logs / "sampler-0.log.1").write_text("first up\n")
    assert run_to_end(talker(tmp_path, "print('third up')", LogLimits(keep=3))) == 0
    assert [(logs / f"sampler-0.log{suffix}").read_text() for suffix in ("", ".1", ".2")] == [
        "third up\n", "second up\n", "first up\n"]


class StoppedConsole(Console):
    """A console nobody reads (`up | less` paused, Ctrl-S): a write waits until `reading` is set."""

    def __init__(self):
        super().__init__()
        self.reading = threading.Event()

    def write(self, text):
        self.reading.wait(timeout=120)
        super().write(text)


def test_a_console_that_is_not_read_does_not_stop_the_run(tmp_path, monkeypatch):
    """The relay wrote to the console itself: a console that stopped reading blocked the relay, then the child on its
    full pipe, and the run looked hung until the stall watch killed it."""
    console = StoppedConsole()
    monkeypatch.setattr(sys, "stdout", console)
    monkeypatch.setattr(up_run, "CONSOLE", QueuedConsole(capacity=100))
    child = talker(tmp_path, TALKER)
    try:
        assert run_to_end(child) == 0  # 20,000 lines, the console taking none of them
        assert len((tmp_path / "logs" / "sampler-0.log").read_text().splitlines()) == 20000
    finally:
        console.reading.set()
    up_run.CONSOLE.drain()
    text = "".join(console.text)
    assert "lines were not shown here while this console was not read; RUN_DIR/logs/ has them all" in text
    assert text.count("[sampler-0] ") <= 102  # the one being written, the 100 queued, the one after the count


def test_a_console_that_is_not_read_holds_a_bounded_number_of_characters(monkeypatch):
    """Only lines were counted: 10,000 waiting pieces of a line without end (LINE_CHARS characters each) held
    640 MiB of `up`'s memory, 2.5 GiB for a child printing emoji, while `up | less` was paused."""
    console = StoppedConsole()
    monkeypatch.setattr(sys, "stdout", console)
    queued = QueuedConsole(capacity_chars=1 << 20)
    piece = "x" * LINE_CHARS + "\n"
    try:
        for _ in range(200):  # 13 Mi characters, far under the 10,000 lines
            queued.write(piece)
        waiting = sum(len(text) for text in list(queued._lines.queue))
        assert waiting <= (1 << 20), f"{waiting} characters waiting"
    finally:
        console.reading.set()
    queued.drain()
    text = "".join(console.text)
    assert "lines were not shown here while this console was not read" in text
