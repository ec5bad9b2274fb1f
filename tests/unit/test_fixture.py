"""`grpo-stream fixture`: builds from a wheel or a GGUF with the pinned sha256, returns a built directory at once,
never leaves a directory that looks complete after a failed or killed build, never deletes what it did not make.
Run on a tiny GGUF (tests/gguf_support.py) standing in for the pinned one; the real wheel: tests/integration/
test_real_model.py."""

import dataclasses
import hashlib
import json
import zipfile

import pytest

from grpo_stream import cli, fixture
from grpo_stream.common.model import gguf_import
from tests.gguf_support import write_tiny_gguf

pytest.importorskip("gguf")
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a GGUF, a wheel holding it, its fixture record)."""
    root = tmp_path_factory.mktemp("fixture")
    write_tiny_gguf(root / "tiny.gguf")
    member = "tiny_pkg/tiny.gguf"
    with zipfile.ZipFile(root / "tiny_pkg-1.0-py3-none-any.whl", "w") as wheel:
        wheel.write(root / "tiny.gguf", member)
    record = dataclasses.replace(fixture.FIXTURES["smollm2"], distribution="tiny-pkg-not-installed", version="1.0",
                                 member=member, sha256=hashlib.sha256((root / "tiny.gguf").read_bytes()).hexdigest())
    return root / "tiny.gguf", root / "tiny_pkg-1.0-py3-none-any.whl", record


@pytest.fixture
def record(tiny, monkeypatch):
    monkeypatch.setitem(fixture.FIXTURES, "tiny", tiny[2])
    return tiny[2]


def count_conversions(monkeypatch, fail_after_files: bool = False) -> list:
    calls, convert = [], gguf_import.convert_gguf

    def counted(path, out, *args, **kwargs):
        calls.append(out)
        if fail_after_files:  # as a build killed midway: some files written, then gone
            (out / "config.json").write_text("{}")
            raise KeyboardInterrupt
        return convert(path, out, *args, **kwargs)

    monkeypatch.setattr(gguf_import, "convert_gguf", counted)
    return calls


def test_builds_from_a_wheel_then_returns_the_cached_directory_at_once(tiny, record, tmp_path, monkeypatch):
    calls, lines = count_conversions(monkeypatch), []
    out = fixture.build_fixture("tiny", tmp_path / "m", tiny[1], say=lines.append)
    assert calls == [tmp_path / ".m.partial"] and fixture.is_complete(out, record)
    marker = json.loads((out / fixture.MARKER).read_text())
    assert marker["gguf_sha256"] == record.sha256 and marker["format"] == fixture.FORMAT and marker["peak_rss_mib"] > 0
    assert any("sha256 verified" in line for line in lines) and any("dequantized" in line for line in lines)
    assert not (tmp_path / ".m.partial").exists()
    lines.clear()
    assert fixture.build_fixture("tiny", out, tiny[1], say=lines.append) == out
    assert len(calls) == 1 and "up to date (cached" in lines[0]


def test_a_killed_build_leaves_nothing_that_looks_complete(tiny, record, tmp_path, monkeypatch):
    calls = count_conversions(monkeypatch, fail_after_files=True)
    with pytest.raises(KeyboardInterrupt):
        fixture.build_fixture("tiny", tmp_path / "m", tiny[0], say=lambda _: None)
    assert calls and not (tmp_path / "m").exists() and (tmp_path / ".m.partial" / "config.json").exists()
    monkeypatch.undo()
    monkeypatch.setitem(fixture.FIXTURES, "tiny", record)
    out = fixture.build_fixture("tiny", tmp_path / "m", tiny[0], say=lambda _: None)  # the leftovers cleared
    assert fixture.is_complete(out, record) and not (tmp_path / ".m.partial").exists()


def test_an_older_format_is_rebuilt_and_a_foreign_directory_is_refused(tiny, record, tmp_path, monkeypatch):
    out = fixture.build_fixture("tiny", tmp_path / "m", tiny[0], say=lambda _: None)
    marker = json.loads((out / fixture.MARKER).read_text())
    (out / fixture.MARKER).write_text(json.dumps({**marker, "format": fixture.FORMAT - 1}))
    calls = count_conversions(monkeypatch)
    fixture.build_fixture("tiny", out, tiny[0], say=lambda _: None)
    assert len(calls) == 1 and fixture.is_complete(out, record)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match=r"--out .*mine: exists and is not a fixture directory"):
        fixture.build_fixture("tiny", tmp_path / "mine", tiny[0], say=lambda _: None)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_a_source_without_the_pinned_sha256_is_refused(tiny, record, tmp_path, monkeypatch):
    monkeypatch.setitem(fixture.FIXTURES, "tiny", dataclasses.replace(record, sha256="0" * 64))
    with pytest.raises(ValueError, match=r"tiny\.gguf has sha256 [0-9a-f]{64}, not the pinned 0{64}"):
        fixture.build_fixture("tiny", tmp_path / "m", tiny[1], say=lambda _: None)
    assert not (tmp_path / "m").exists()


def test_the_command_names_a_bad_source_and_exits_2(tmp_path, capsys):
    (tmp_path / "x.bin").write_bytes(b"x")
    assert cli.main(["fixture", "smollm2", "--out", str(tmp_path / "m"), "--source", str(tmp_path / "x.bin")]) == 2
    assert "x.bin: neither a .whl nor a .gguf file" in capsys.readouterr().err
