"""Child process of test_activation_sharding.py (it needs fake devices: XLA_FLAGS is set before JAX starts).

Compiles the gradient of a tiny-architecture model's sequence logprobs on an fsdp=2 mesh of fake CPU devices, with
and without `activation_sharding`, and prints one JSON document: each program's temporaries per device (XLA's
memory analysis) and the sharding constraints in each lowered program. Nothing is executed: two fake CPU devices
meeting at a collective hung now and then on a loaded 2-core machine (a constraint does not change what is computed,
and the multi-device end-to-end runs execute these programs).
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.config.learning import ModelSection
from grpo_stream.common.model.activation_sharding import activation_sharding
from grpo_stream.common.model.policy import build_from_architecture, sequence_logprobs, tiny_architecture
from grpo_stream.common.model.sharding import make_mesh, place, rows_sharding


def main() -> int:
    fsdp, rows, length = 2, 16, 128
    section = ModelSection(kind="tiny", tiny={"vocab_size": 4096, "embed_dim": 256, "num_layers": 2, "hidden_dim": 1024,
                                              "num_heads": 4, "num_kv_heads": 2, "head_dim": 64})
    model = build_from_architecture(tiny_architecture(section, 4096), 0, jnp.float32)
    mesh = make_mesh(fsdp, 1, jax.devices(), "trainer.mesh")
    params = place(model.params, mesh)
    rng = np.random.default_rng(0)
    tokens = jax.device_put(jnp.asarray(rng.integers(1, 4096, (rows, length)), jnp.int32), rows_sharding(mesh, rows))
    valid = jax.device_put(jnp.ones((rows, length), jnp.bool_), rows_sharding(mesh, rows))

    def loss(p, t, v):
        return sequence_logprobs(model, p, t, v, 1.0, 0).sum()

    def constrained(p, t, v):
        with activation_sharding(mesh):
            return jax.grad(loss)(p, t, v)

    out = {}
    for name, fn in (("plain", jax.grad(loss)), ("constrained", constrained)):
        lowered = jax.jit(fn).lower(params, tokens, valid)
        out[name] = {"temporaries": int(lowered.compile().memory_analysis().temp_size_in_bytes),
                     "constraints": lowered.as_text().count("sharding_constraint")}
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
