"""Activation sharding in the trainer's programs (common/model/activation_sharding.py): with it Tunix's own
activation constraints are in the compiled program on CPU as on TPU/GPU, the program keeps fewer temporaries per
device on an fsdp mesh, and the gradients are the same. On fake CPU devices, in a child process (the device count is
fixed when JAX starts)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp

from grpo_stream.common.model.activation_sharding import activation_sharding, constrain
from grpo_stream.plan_command import child_env

ROOT = pathlib.Path(__file__).resolve().parents[4]


def test_constraints_are_in_the_program_save_memory_and_keep_the_gradients():
    env = child_env(2)
    # two fake devices meet at each collective; on a loaded 2-core machine one can be late by more than XLA's
    # default 40 s, which would abort the child rather than fail a check
    env["XLA_FLAGS"] += " --xla_cpu_collective_call_terminate_timeout_seconds=600"
    proc = subprocess.run([sys.executable, "-m", "tests.unit.common.model.activation_sharding_child"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc["plain"]["constraints"] == 0  # Tunix's shard() does nothing on CPU outside the block
    # hidden states, heads and MLP activations of both layers, and the logits, forward and backward
    assert doc["constrained"]["constraints"] >= 10
    assert doc["constrained"]["temporaries"] < 0.9 * doc["plain"]["temporaries"], doc
    assert doc["relative_difference"] < 1e-5


def test_outside_a_block_or_on_one_device_nothing_is_constrained():
    x = jnp.ones((4, 8, 16))
    assert constrain(x, ("fsdp", None, "tp")) is x
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("fsdp",))
    with activation_sharding(mesh):  # one device: nothing to lay out
        assert constrain(x, ("fsdp", None, None)) is x
