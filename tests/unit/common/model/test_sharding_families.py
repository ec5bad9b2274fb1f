"""A sharded update computes what the one-device update computes: every registered family's tiny model trained on
fake CPU devices (fsdp x tp) against one device, LoRA on and off, packing on and off (the families take turns:
sharding_families_child.py), with the parameters and Adam moments on the shardings param_shardings documents and
the update's inputs donated; and the sampler's engine on a tp mesh generates the tokens and logprobs of one device.
In a child process (the device count is fixed when JAX starts)."""

import json
import pathlib
import subprocess
import sys

import pytest

from grpo_stream.plan.memory import child_env

ROOT = pathlib.Path(__file__).resolve().parents[4]

CHILD = "tests.unit.common.model.sharding_families_child"


def assert_same_as_one_device(report: dict) -> None:
    sampler = report.pop("sampler")
    assert sampler["tokens_equal"] and sampler["logprob_gap"] < 1e-4, sampler
    for family, r in report.items():
        # float32 rounding only: reductions split over devices add in another order
        assert r["grads"] < 1e-5 and r["loss"] < 1e-5, (family, r)
        assert r["moved"] > 1e-3 and r["params"] < 1e-4, (family, r)  # two updates moved it, the same way
        assert r["misplaced"] == [], (family, r["misplaced"])
        assert r["kept"] == [], (family, "not donated", r["kept"])


@pytest.mark.heavy  # ~75 s (stop 76); the 1x4 sharded update on Qwen3 stays in the default lane
def test_a_tp_mesh_wider_than_the_kv_heads_trains_as_one_device():
    """tp=4 over 2 KV heads (their projections replicated over tp, the query heads split): Qwen3 (per-head norms)
    over packed rows. LoRA, Qwen2 (biases, tied embeddings) and every other family, on 2x2: `heavy` (each family
    here is ~40 s of a worker)."""
    assert_same_as_one_device(child_report_of("1x4", "qwen3"))


@pytest.mark.heavy  # every family: ~3 min on 2 loaded cores
def test_every_family_on_an_fsdp_by_tp_mesh_trains_as_one_device():
    report = child_report_of("2x2")
    assert {(r["lora"], r["packing"]) for k, r in report.items() if k != "sampler"} == {
        (False, True), (True, False), (True, True), (False, False)}
    assert_same_as_one_device(report)


def child_report_of(mesh: str, families: str = "") -> dict:
    """The child's JSON report of `mesh` ('FSDPxTP', as many fake devices) for `families` (default all)."""
    fsdp, tp = (int(x) for x in mesh.split("x"))
    proc = subprocess.run([sys.executable, "-m", CHILD, mesh, *filter(None, [families])], cwd=ROOT,
                          env=child_env(fsdp * tp), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)
