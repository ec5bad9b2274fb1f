"""The committed generated protobuf code must be what `python -m protos.generate` produces."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh():
    proc = subprocess.run([sys.executable, "-m", "protos.generate", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_check_detects_stale_code(tmp_path, monkeypatch):
    import protos.generate as gen

    fake = tmp_path / "protos"
    fake.mkdir()
    for p in gen.PROTO_DIR.glob("*"):
        if p.is_file():
            (fake / p.name).write_bytes(p.read_bytes())
    (fake / "rollout_pb2.py").write_text("# edited by hand\n")
    monkeypatch.setattr(gen, "PROTO_DIR", fake)
    assert gen.main(["--check"]) == 1
