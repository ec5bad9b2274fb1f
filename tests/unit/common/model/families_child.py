"""Child process of test_families.py (fake devices: XLA_FLAGS is set before JAX starts).

For every registered family, lowers (does not compile or run) the tiny model's sequence logprobs on an fsdp=2 mesh
of fake CPU devices, with and without `activation_sharding`, and prints one JSON document: the sharding constraints in
each lowered program, per family.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.model.activation_sharding import activation_sharding
from grpo_stream.common.model.architectures import from_hf_config
from grpo_stream.common.model.families import FAMILIES
from grpo_stream.common.model.policy import build_from_architecture, sequence_logprobs
from grpo_stream.common.model.sharding import make_mesh, place, rows_sharding


def constraints(record, mesh) -> dict:
    arch = from_hf_config(dict(record.tiny_hf_config))
    model = build_from_architecture(arch, 0, jnp.float32)
    params = place(model.params, mesh)
    rows, length = 4, 16
    tokens = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(1, arch.vocab_size, (rows, length)),
                                        jnp.int32), rows_sharding(mesh, rows))
    valid = jax.device_put(jnp.ones((rows, length), jnp.bool_), rows_sharding(mesh, rows))

    def plain(p, t, v):
        return sequence_logprobs(model, p, t, v, 1.0, 0).sum()

    def constrained(p, t, v):
        with activation_sharding(mesh):
            return plain(p, t, v)

    return {name: jax.jit(fn).lower(params, tokens, valid).as_text().count("sharding_constraint")
            for name, fn in (("plain", plain), ("constrained", constrained))}


def main() -> int:
    mesh = make_mesh(2, 1, jax.devices(), "trainer.mesh")
    json.dump({record.family: constraints(record, mesh) for record in FAMILIES}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
