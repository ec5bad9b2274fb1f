"""gpu-check's real-model phase, the parts that need no GPU: the GGUF cut into parts one device call can carry and
joined back byte for byte (in numeric order past part-9), the run's arguments a valid config, the phase skipped with
the way to bring the parts when none were carried."""

import pathlib

from grpo_stream import fixture
from grpo_stream.common.config.loading import load_config
from grpo_stream.gpu_check import realmodel

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_split_parts_fit_one_call_and_join_back(tmp_path, monkeypatch):
    data = pathlib.Path(tmp_path / "model.gguf")
    data.write_bytes(bytes(range(256)) * 4099)  # 1,049,344 bytes
    monkeypatch.setattr(fixture, "gguf_file", lambda *_args: (data, "test"))
    parts = realmodel.split(tmp_path / "parts", part_bytes=100_000)
    assert len(parts) == 11 and all(p.stat().st_size <= 100_000 for p in parts)
    assert realmodel.PART_BYTES < 64 << 20
    joined = realmodel.join(tmp_path / "parts", tmp_path / "joined.gguf")
    assert joined.read_bytes() == data.read_bytes()  # part-10 after part-9, not after part-1
    assert realmodel.join(tmp_path / "empty", tmp_path / "none.gguf") is None


def test_the_run_arguments_are_a_valid_config(tmp_path):
    for dry in (False, True):
        args = realmodel.up_args(tmp_path / "model", tmp_path / "gsm8k", 20, dry)
        cfg = load_config(ROOT / args[1], args[2:])
        assert cfg.model.path == str(tmp_path / "model") and cfg.trainer.steps == 20 and cfg.task.name == "gsm8k"


class Runner:
    def __init__(self, work):
        self.work = work


def test_without_parts_the_phase_says_how_to_bring_them(tmp_path, monkeypatch):
    monkeypatch.setattr(realmodel, "PARTS", tmp_path / "nothing")
    result = realmodel.realmodel_phase(Runner(tmp_path), tmp_path)
    assert result["status"] == "skipped" and "grpo_stream.gpu_check.realmodel split" in result["reason"]
