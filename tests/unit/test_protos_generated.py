"""The committed generated protobuf code must be what `python -m grpo_stream.protos.generate` produces."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh():
    proc = subprocess.run([sys.executable, "-m", "grpo_stream.protos.generate", "--check"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_check_detects_stale_missing_and_extra_files(tmp_path):
    import grpo_stream.protos.generate as gen

    written = gen.generate(tmp_path / "gen")
    committed = tmp_path / "committed"
    committed.mkdir()
    for p in gen.PROTO_DIR.glob("*_pb2*.py*"):
        (committed / p.name).write_bytes(p.read_bytes())
    assert gen.stale_files(written, committed) == []
    (committed / "rollout_pb2.py").write_text("# edited by hand\n")
    (committed / "weights_pb2.pyi").unlink()
    (committed / "old_pb2.py").write_text("")
    assert sorted(gen.stale_files(written, committed)) == ["old_pb2.py", "rollout_pb2.py", "weights_pb2.pyi"]
