"""Child process of test_engine_mesh.py (fake devices: XLA_FLAGS is set before JAX starts).

Serves the same prompts with the continuous engine on one device and on a (1, tp) mesh of all the fake devices, for a
tiny Llama with 8 query heads and argv[1] KV heads, and prints one JSON document: greedy and sampled tokens and
logprobs against one device's, per device the bytes of the caches the serve left and of a new group (`empty`), their
totals, and the largest collective of the compiled decode chunk (elements of its result) against one layer's keys.
"""

import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.model.architectures import from_hf_config
from grpo_stream.common.model.families import LLAMA3
from grpo_stream.common.model.policy import build_from_architecture
from grpo_stream.common.model.sharding import make_mesh, place

COLLECTIVE = re.compile(r"= (.*?) (?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


def tiny_model(kv_heads: int):
    config = {**LLAMA3.tiny_hf_config, "num_attention_heads": 8, "num_key_value_heads": kv_heads,
              "head_dim": 8}
    model = build_from_architecture(from_hf_config(config), 0, jnp.float32)
    rng = np.random.default_rng(7)  # Tunix starts the MLP at zero: random weights make every layer count
    named = {k: (rng.normal(0, 0.1, v.shape) if v.ndim >= 2 else v).astype(np.float32)
             for k, v in model.to_named_numpy().items()}
    return dataclasses.replace(model, params=model.from_named_numpy(named))


def per_device_bytes(tree) -> dict:
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def largest_collective(engine, weights, group) -> int:
    hlo = engine.device.decode.lower(weights, (group.state,), jnp.int32(1), windows=(group.window,)).compile()
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
             for m in COLLECTIVE.finditer(hlo.as_text()) for dims in re.findall(r"\[([0-9,]*)\]", m.group(1))]
    return max(sizes, default=0)


def report(kv_heads: int) -> dict:
    model = tiny_model(kv_heads)
    prompts = [list(np.random.default_rng(i).integers(3, 128, 4 + i % 6)) for i in range(12)]
    mesh = make_mesh(1, len(jax.devices()), jax.devices(), "sampler.mesh.tp")
    placed = place(jax.tree.map(jnp.copy, model.params), mesh)
    runs = {}
    for name, params in (("one", model.params), ("mesh", placed)):
        engine = ContinuousEngine(model, 0, [1], max_prompt_tokens=12, max_new_tokens=16, temperature=1.0, slots=8)
        runs[name] = (engine, [engine.generate(params, prompts, jax.random.key(3), greedy=greedy)
                               for greedy in (True, False)])
    engine, outs = runs["mesh"]
    refs = runs["one"][1]
    group = engine.table.main
    fresh = engine.device.empty(size=group.size, window=group.window)
    return {"tokens_equal": [bool(np.array_equal(a.tokens, b.tokens)) for a, b in zip(refs, outs)],
            "logprob_gap": max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(refs, outs)),
            "cache_total": sum(x.nbytes for x in jax.tree.leaves(group.state.cache)),
            "cache_per_device": per_device_bytes(group.state.cache),
            "new_group_per_device": per_device_bytes(fresh.cache), "devices": len(jax.devices()),
            "largest_collective": largest_collective(engine, engine._weights(placed), group),
            "layer_keys": int(np.prod(group.state.cache[0][0].shape))}


def main() -> int:
    print(json.dumps({kv: report(int(kv)) for kv in sys.argv[1].split(",")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
