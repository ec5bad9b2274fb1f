"""The continuous engine on a sampler's tp mesh (4 fake CPU devices, in a child process: engine_mesh_child.py): the
tokens and logprobs of one device, the KV caches split over tp by their KV heads (whole on every device where tp does
not divide them), a new slot group made on the mesh rather than whole on one device, and no collective of a cache's
size in the decode chunk."""

import json
import pathlib
import subprocess
import sys

import pytest

from grpo_stream.plan.memory import child_env

ROOT = pathlib.Path(__file__).resolve().parents[4]
CHILD = "tests.unit.common.engine.engine_mesh_child"


@pytest.mark.heavy  # 31-35 s (CI time); the default lane's 1x4 sharded update checks the engine on tp=4 decodes
# as one device (test_sharding_families.py)
def test_the_engine_on_a_tp_mesh_decodes_as_one_device_with_its_caches_laid_out():
    """tp=4 over 4 KV heads: each device holds a quarter of the caches, a new group's too (it was made whole on one
    device). tp=4 over 2 KV heads: the caches are whole on every device, and the decode chunk no longer all-reduces
    all of them after every chunk. Both: the tokens and logprobs of one device."""
    proc = subprocess.run([sys.executable, "-m", CHILD, "4,2"], cwd=ROOT, env=child_env(4), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kv_heads, report in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert report["tokens_equal"] == [True, True] and report["logprob_gap"] < 1e-4, (kv_heads, report)
        tp, total = report["devices"], report["cache_total"]
        share = total // tp if int(kv_heads) % tp == 0 else total
        assert sorted(report["cache_per_device"].values()) == [share] * tp, (kv_heads, report)
        assert sorted(report["new_group_per_device"].values()) == [share] * tp, (kv_heads, report)
        # the largest collective an activation needs is the [rows, vocabulary] logits; one layer's keys are 8x that
        assert report["largest_collective"] < report["layer_keys"], (kv_heads, report)
