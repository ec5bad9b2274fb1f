"""Child process of test_vllm_tpu.py (8 fake CPU devices: XLA_FLAGS is set before JAX starts).

A stand-in of the object graph Tunix's vLLM sampler writes into on TPU: llm.llm_engine.model_executor.driver_worker
.model_runner with an nnx State of the engine's weights, sharded over a mesh axis named 'model' (tpu-inference's),
a flat `state_leaves` tuple, and `collective_rpc` / `reset_prefix_cache` that record each call and what the state
held at that moment. Per family with a vLLM-JAX name map (vllm_tpu.FAMILIES) a tiny policy of that family is
installed twice (two versions) through VllmTpuWeightWriter, and the checks' outcomes are printed as one JSON document.
"""

import importlib
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_stream.common.engine.vllm_tpu import (FAMILIES, VllmTpuWeightError, VllmTpuWeightWriter, family_mapping,
                                                flat_state)
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.families import family_named
from grpo_stream.common.model.policy import build_from_architecture
from grpo_stream.common.model.sharding import fit_spec

TP = 8


def tiny(family: str) -> Architecture:
    return Architecture(family=family, vocab_size=512, num_layers=2, embed_dim=64, hidden_dim=128, num_heads=8,
                        num_kv_heads=2, head_dim=16, norm_eps=1e-6, rope_theta=10_000, tied_embeddings=False)


def nested(flat: dict) -> dict:
    out: dict = {}
    for name, value in flat.items():
        node, keys = out, name.split(".")
        for key in keys[:-1]:
            node = node.setdefault(int(key) if key.isdigit() else key, {})
        node[keys[-1]] = value
    return out


class Recorder:
    def __init__(self):
        self.calls = []


class Runner:
    """tpu-inference's JAX model runner as the writer sees it: `state`, `state_leaves`."""

    def __init__(self, state):
        self.state = state
        self.state_leaves = tuple(jax.tree_util.tree_leaves(state))


class Llm:
    def __init__(self, runner: Runner, recorder: Recorder):
        self.recorder = recorder
        worker = type("Worker", (), {"model_runner": runner})()
        executor = type("Executor", (), {"driver_worker": worker})()
        self.llm_engine = type("Engine", (), {"model_executor": executor})()
        self._runner = runner

    def _first_leaf(self):
        return self._runner.state_leaves[0]

    def reset_prefix_cache(self):
        self.recorder.calls.append(["reset_prefix_cache", id(self._first_leaf())])

    def collective_rpc(self, method, *args, **kwargs):
        self.recorder.calls.append([f"rpc:{method}", id(self._first_leaf())])


def engine_layout(family: str, named: dict, mesh: Mesh):
    """The engine's state for a policy with weights `named`: the vLLM-JAX names, K/V heads repeated to the tensor
    parallel width, the embedding held transposed (what the map's transpose declares), bfloat16, sharded by the
    map's specs on 'model'. Returns (state, the expected engine array per target)."""
    names, _ = family_mapping(family)
    module = importlib.import_module(family_named(family).vllm_tpu.mapping_module)
    specs = {src: spec for src, (_, spec) in module.VLLM_JAX_MAPPING["to_hf_mappings"].items()}
    flat, expected = {}, {}
    for source, x in named.items():
        key = next(k for k in names if _matches(k, source))
        layer = source.split(".")[1] if key.startswith("layers.*") else None
        target = names[key].replace("*", layer) if layer else names[key]
        y = np.asarray(x)
        if "embedding" in source:
            y = y.T
        if source.endswith(("k_proj.w", "v_proj.w")):
            y = np.repeat(y, TP // y.shape[1], axis=1)
        y = jnp.asarray(y, jnp.bfloat16)
        spec = specs[key]
        spec = spec if len(spec) == y.ndim else (None,) * y.ndim
        sharding = NamedSharding(mesh, fit_spec(PartitionSpec(*spec), y.shape, mesh))
        expected[target] = (np.asarray(y.astype(jnp.float32)), sharding)
        flat[target] = nnx.Param(jax.device_put(jnp.zeros(y.shape, jnp.bfloat16), sharding))
    return nnx.State(nested(flat)), expected


def _matches(pattern: str, name: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name) is not None


def run(family: str) -> dict:
    mesh = Mesh(np.asarray(jax.devices()[:TP]), ("model",))
    policy = build_from_architecture(tiny(family), 0, jnp.float32)
    named = {n: np.asarray(x) for n, x in policy.to_named_numpy().items()}
    state, expected = engine_layout(family, named, mesh)
    runner, recorder = Runner(state), Recorder()
    llm = Llm(runner, recorder)
    writer = VllmTpuWeightWriter(llm, family, list(named))
    out = {"targets": len(writer.targets), "leaves": len(expected), "salt_before": writer.cache_salt}
    before = {t: leaf.get_value() for t, leaf in flat_state(runner.state).items()}
    first_old = id(runner.state_leaves[0])
    writer.install(named, version=3, epoch="e1")
    after = flat_state(runner.state)
    out["values_equal"] = all(np.array_equal(np.asarray(after[t].get_value().astype(jnp.float32)), e)
                              for t, (e, _) in expected.items())
    out["dtypes"] = sorted({str(after[t].get_value().dtype) for t in expected})
    out["shardings_kept"] = all(after[t].get_value().sharding == s for t, (_, s) in expected.items())
    out["old_deleted"] = all(x.is_deleted() for x in before.values())
    out["leaves_rebuilt"] = (len(runner.state_leaves) == len(expected)
                             and all(a is b for a, b in zip(runner.state_leaves, jax.tree_util.tree_leaves(runner.state))))
    new_first = id(runner.state_leaves[0])
    out["calls"] = [[name, "old" if leaf == first_old else "new" if leaf == new_first else "?"]
                    for name, leaf in recorder.calls]
    out["version"], out["salt"] = writer.version, writer.cache_salt
    named2 = {n: x * 2 for n, x in named.items()}
    writer.install(named2, version=4, epoch="e1")
    out["second_salt"] = writer.cache_salt
    out["second_values"] = all(np.allclose(np.asarray(flat_state(runner.state)[t].get_value().astype(jnp.float32)), 2 * e,
                                           rtol=1e-2) for t, (e, _) in expected.items())
    errors = {}
    for case, fn in {
        "version_lacks_a_weight": lambda: writer.install({n: x for n, x in named.items()
                                                          if n != "final_norm.w"}, 5, "e1"),
        "unknown_source_name": lambda: VllmTpuWeightWriter(llm, family, [*named, "layers.0.attn.extra.w"]),
        "state_lacks_a_target": lambda: VllmTpuWeightWriter(llm, family, [*named, "layers.7.attn.q_proj.w"]),
        "state_leaf_unfilled": lambda: VllmTpuWeightWriter(llm, family, [n for n in named if n != "final_norm.w"]),
        "shape_mismatch": lambda: writer.install({**named, "final_norm.w": np.zeros(63, np.float32)}, 6, "e1"),
        # half the engine's head dimension: a multiple, but never repeated (a padded head dimension is not K/V heads)
        "head_dim_differs": lambda: writer.install({**named, "layers.0.attn.k_proj.w": np.zeros((64, TP, 8),
                                                                                             np.float32)}, 7, "e1"),
    }.items():
        try:
            fn()
            errors[case] = None
        except VllmTpuWeightError as exc:
            errors[case] = str(exc)
    out["errors"] = errors
    # a refused version leaves the engine as it was: version 4's weights, no call made
    out["version_after_errors"] = writer.version
    out["calls_after_errors"] = len(recorder.calls)
    out["values_after_errors"] = all(np.allclose(np.asarray(flat_state(runner.state)[t].get_value().astype(
        jnp.float32)), 2 * e, rtol=1e-2) for t, (e, _) in expected.items())
    # an in-flight write (live requests keep their KV): the cache is neither freed nor rebuilt
    kept = len(recorder.calls)
    writer.install({n: x * 3 for n, x in named.items()}, version=5, epoch="e1", keep_kv=True)
    out["keep_kv_calls"] = [name for name, _ in recorder.calls[kept:]]
    out["keep_kv_values"] = all(np.allclose(np.asarray(flat_state(runner.state)[t].get_value().astype(jnp.float32)),
                                            3 * e, rtol=1e-2) for t, (e, _) in expected.items())
    out["keep_kv_salt"] = writer.cache_salt
    return out


def main() -> int:
    json.dump({family: run(family) for family in FAMILIES}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
