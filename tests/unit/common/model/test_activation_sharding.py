"""Activation sharding in the trainer's programs (common/model/activation_sharding.py): with it Tunix's own
activation constraints are in the compiled program on CPU as on TPU/GPU, and the program keeps fewer temporaries per
device on an fsdp mesh. On fake CPU devices, in a child process (the device count is fixed when JAX starts). The
multi-device end-to-end runs (tests/e2e/test_lora_run.py over grpc, test_weight_meshes.py) execute such programs."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp

from grpo_stream.common.model.activation_sharding import activation_sharding, constrain
from grpo_stream.plan.memory import child_env

ROOT = pathlib.Path(__file__).resolve().parents[4]


def test_constraints_are_in_the_program_and_save_memory():
    proc = subprocess.run([sys.executable, "-m", "tests.unit.common.model.activation_sharding_child"], cwd=ROOT,
                          env=child_env(2), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["plain"]["constraints"] == 0  # Tunix's shard() does nothing on CPU outside the block
    # hidden states, heads and MLP activations of both layers, and the logits, forward and backward
    assert doc["constrained"]["constraints"] >= 10
    assert doc["constrained"]["temporaries"] < 0.9 * doc["plain"]["temporaries"], doc


def test_outside_a_block_or_on_one_device_nothing_is_constrained():
    x = jnp.ones((4, 8, 16))
    assert constrain(x, ("fsdp", None, "tp")) is x
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("fsdp",))
    with activation_sharding(mesh):  # one device: nothing to lay out
        assert constrain(x, ("fsdp", None, None)) is x
