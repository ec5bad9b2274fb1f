"""The relay of a child's output (grpo_stream/up/relay.py): it keeps draining the child's pipe whatever it meets (a
log on a full disk, bytes that are not UTF-8), so a child of `up` never blocks on a full pipe and looks hung; and
what it could not keep in the log is said there once the log can be written again. Real child processes."""

from __future__ import annotations

import errno
import os
import sys

from grpo_stream.up.processes import ProcessSpec
from grpo_stream.up.relay import ChildLog
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


def talker(tmp_path, code: str) -> _Child:
    (tmp_path / "logs").mkdir(exist_ok=True)
    return _Child(ProcessSpec("sampler-0", (sys.executable, "-c", code), dict(os.environ), "sampler", "sampler-0"),
                  tmp_path / "logs")


def run_to_end(child: _Child) -> int:
    child.start()
    try:
        return child.proc.wait(timeout=60)  # before the fix: blocked on its full pipe, for ever
    finally:
        child.kill()
        child._relay.join(timeout=10)


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
