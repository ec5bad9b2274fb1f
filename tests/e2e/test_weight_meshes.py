"""Weights across meshes and processes (issue 6): an FSDP trainer publishes, tensor-parallel samplers install.

Each run is `grpo-stream up` as real processes: the trainer sees 4 (fake CPU) devices and shards its
parameters and optimizer state fsdp=4; each of two sampler processes sees 2 devices and installs every
version tp=2. With weights.verify_prompts the trainer and each sampler record a SHA-256 of their final
parameters (float32 bytes) and greedy completions of held-out prompts; they must be identical.
"""

import json
import pathlib

import pytest

from tests.e2e.test_up import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SMALL = ["trainer.steps=3", "trainer.groups_per_step=8", "trainer.eval_before=false", "trainer.eval_after=false",
         "weights.verify_prompts=8", "eval.batch_size=8", "generation.num_generations=4", "sampler.replicas=2"]


def check_exact(run_dir: pathlib.Path, trainer_mesh: dict, sampler_tp: int, steps: int = 3) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_mesh"] == trainer_mesh
    final = summary["final_weights"]
    assert final["version"] == steps and len(final["greedy"]) == 8 and any(final["greedy"])
    assert set(summary["samplers"]) == {"sampler-0", "sampler-1"}
    for name, doc in summary["samplers"].items():
        assert doc["versions"][-1] == steps and doc["versions"] == sorted(doc["versions"])
        assert doc["final_weights"]["sha256"] == final["sha256"], f"{name}: parameters differ from the trainer's"
        assert doc["final_weights"]["greedy"] == final["greedy"], f"{name}: greedy outputs differ"
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("*.log"))
    assert logs.count(f"mesh {{'fsdp': 1, 'tp': {sampler_tp}}}") == 2
    return summary


# heavy, both transports (a minute each on 2 cores): the default lane reshards fsdp4 -> tp2 over grpc across processes
# in tests/e2e/test_multihost_trainer.py (two trainer processes; the samplers' final SHA-256 and greedy outputs equal)
@pytest.mark.heavy
@pytest.mark.parametrize("transport", ["grpc", "checkpoint"])
def test_fsdp4_trainer_to_two_tp2_sampler_processes(tmp_path, transport):
    run_dir = tmp_path / "run"
    out = run_cli("up", "--run-dir", str(run_dir), *SMALL, "trainer.mesh.fsdp=4", "sampler.mesh.tp=2",
                  f"weights.transport={transport}", "weights.keep_versions=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = check_exact(run_dir, {"fsdp": 4, "tp": 1}, 2)
    assert summary["weight_transport"] == transport
    if transport == "checkpoint":  # complete versions on disk, pruned to keep_versions
        kept = sorted(p.name for p in (run_dir / "weights").iterdir() if p.name.startswith("v"))
        assert len(kept) == 2 and kept[-1].startswith("v0000000003-")
        assert all((run_dir / "weights" / k / "COMPLETE").exists() for k in kept)
        assert json.loads((run_dir / "weights" / "LATEST").read_text())["version"] == 3


@pytest.mark.heavy  # 45 s; the fsdp4 -> tp2 resharding across processes: as above
def test_single_controller_splits_devices_and_moves_weights_in_process(tmp_path):
    run_dir = tmp_path / "run"
    out = run_cli("up", "--run-dir", str(run_dir), *SMALL, "trainer.mesh.fsdp=2", "sampler.mesh.tp=1",
                  "weights.transport=local", "weights.trainer_devices_fraction=0.5",
                  "weights.sampler_devices_fraction=0.5")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    check_exact(run_dir, {"fsdp": 2, "tp": 1}, 1)
    log = (run_dir / "logs" / "colocated.log").read_text()
    assert "trainer on 2 devices, 2 samplers on [[2], [3]]" in log
