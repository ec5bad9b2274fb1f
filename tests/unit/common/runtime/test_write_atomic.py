"""write_atomic as a machine crash and a foreign locale meet it: the text is on disk before the file takes its name,
the rename is on disk before it returns, and the file is UTF-8 whatever the locale."""

import os
import pathlib
import subprocess
import sys

from grpo_stream.common.runtime.files import write_atomic

ROOT = pathlib.Path(__file__).resolve().parents[4]


def test_the_text_is_synced_before_the_rename_and_the_rename_after(tmp_path, monkeypatch):
    """Without an fsync before os.replace, a host crash (a power cut, a kernel panic) soon after could leave the new
    name on an empty or partial file on ext4 / XFS (the data not yet written, the rename already journalled): the
    config record `up` compares on a restart, the summary.json a reader parses, were "whole or not at all" only
    against a killed process."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "summary.json"
    write_atomic(target, '{"steps": 6}')
    assert [kind for kind, _ in events] == ["fsync", "replace", "fsync"], events
    synced_first = pathlib.Path(events[0][1])
    assert synced_first.parent == tmp_path and synced_first.name.startswith(".summary.json.")  # the temporary file
    assert events[1][1] == str(target) and events[2][1] == str(tmp_path)  # then the directory holding the new name
    assert target.read_text() == '{"steps": 6}'


def test_text_is_written_as_utf8_whatever_the_locale(tmp_path):
    """The text went out in the locale's encoding: `grpo-stream report` under a locale that is not UTF-8 (C without
    Python's coercion, a Latin-1 one) failed on report.md's arrows (UnicodeEncodeError), or wrote a file no UTF-8
    reader (a browser, a Markdown viewer, jq) reads right."""
    target = tmp_path / "report.md"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    code = ("import pathlib, sys; from grpo_stream.common.runtime.files import write_atomic; "
            "write_atomic(pathlib.Path(sys.argv[1]), 'accuracy 0.1 \\u2192 0.4, na\\u00efve')")
    proc = subprocess.run([sys.executable, "-c", code, str(target)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == "accuracy 0.1 \u2192 0.4, na\u00efve".encode()
