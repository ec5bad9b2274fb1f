"""The trainer's weights written in place into an in-process vllm-tpu engine (tpu-inference's JAX model runner).

vllm-tpu has no endpoint that takes new weights. Its model runner holds the model as an nnx `State` of JAX arrays
(`llm.llm_engine.model_executor.driver_worker.model_runner.state`, the path Tunix's vLLM sampler uses, with the
engine core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0) and a flat `state_leaves` tuple its compiled
programs are called with. A version is installed by replacing those arrays, in the order tpu-inference needs:

1. `reset_prefix_cache()`: cached prompt KV was computed with the old weights;
2. `collective_rpc("delete_kv_cache")`: frees the KV cache, so the old and new weights are never both beside it;
3. every mapped leaf written: renamed (the family's Tunix -> vLLM-JAX name map, shipped with Tunix and named by the
   family's record, `ModelFamily.vllm_tpu`), transposed where the map says and the shapes ask for it, KV heads
   repeated where the engine keeps more heads than the model has (tensor parallelism wider than the KV heads), cast
   to the engine's dtype, placed on the sharding the engine compiled against, and the old buffer deleted at once;
4. `state_leaves` rebuilt from the state (the runner's programs take the flat tuple, not the state);
5. `collective_rpc("reinitialize_kv_cache")`.
With in-flight updates (`keep_kv`) steps 2 and 5 are left out: live requests keep their cache, and each leaf's old
buffer is freed as its new one is placed, so a leaf, not the model, is the most held twice.

Each installed version gets its own `cache_salt` (trainer epoch and version): vLLM keys its prefix cache by it, so
no request of one version can reuse KV computed under another, even if a reset were missed.

Nothing here can run on this project's machines as on a TPU: the writer is tested against a stand-in of that object
graph on fake CPU devices (tests/unit/common/engine/test_vllm_tpu.py); docs/tpu.md says what ran where.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.engine.vllm_weight_check import WeightsMismatch
from grpo_stream.common.model import families as family_records

RUNNER_PATH = ("llm_engine", "model_executor", "driver_worker", "model_runner")
# the families whose record names a vLLM-JAX name map (those Tunix ships one for)
FAMILIES = tuple(f.family for f in family_records.FAMILIES if isinstance(f.vllm_tpu, family_records.VllmTpuSupport))
KV_NAME = re.compile(r"\.(k_proj|v_proj)\.|\.(k_bias|v_bias)$")


class VllmTpuWeightError(ValueError):
    """A version that cannot be written into the engine (a name, shape or dtype that does not fit)."""


class VersionRefused(VllmTpuWeightError, WeightsMismatch):
    """A version refused by `VllmTpuWeightWriter.install` before any write: the engine keeps the one it had."""


def model_runner(llm: Any) -> Any:
    """The model runner of an in-process vLLM engine, by Tunix's attribute path; the first missing step is named."""
    node = llm
    for i, name in enumerate(RUNNER_PATH):
        if not hasattr(node, name):
            raise VllmTpuWeightError(
                f"the vLLM engine has no llm.{'.'.join(RUNNER_PATH[:i + 1])}: the TPU weight writer needs the engine "
                "core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and tpu-inference's JAX model runner")
        node = getattr(node, name)
    if not hasattr(node, "state"):
        raise VllmTpuWeightError("the vLLM model runner has no `state`: not tpu-inference's JAX runner (on GPU and "
                                 "CPU the vLLM engine loads weights through load_weights instead)")
    return node


def family_mapping(family: str) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """(Tunix name pattern -> vLLM-JAX name pattern, name fragment -> transpose axes) for `family`, from the map its
    record names (`ModelFamily.vllm_tpu`); a family without one is refused with the record's reason."""
    try:
        support = family_records.family_named(family).vllm_tpu
    except ValueError as exc:
        raise VllmTpuWeightError(str(exc)) from None
    if isinstance(support, family_records.Unsupported):
        raise VllmTpuWeightError(f"model family {family!r}: the TPU weight writer cannot serve it: {support.reason} "
                                 f"(families with a vLLM-JAX name map: {', '.join(FAMILIES)})")
    mapping = importlib.import_module(support.mapping_module).VLLM_JAX_MAPPING
    names = {src: dst for src, (dst, _spec) in mapping["to_hf_mappings"].items()}
    return names, dict(mapping.get("to_hf_transpose_keys") or {})


def _pattern(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(r"\*", r"(\d+)") + "$")


def flat_state(state: Any) -> dict[str, Any]:
    """'model.layers.0.self_attn.q_proj.kernel' -> the leaf (an nnx Variable or a bare array) of an nnx State."""
    from flax import nnx  # noqa: PLC0415 - deferred: flax only for tpu-inference's state

    # tpu-inference's Llama keeps an nnx.Rngs in its state (rng.default.key/count): not a weight, never written
    return {".".join(str(k) for k in path): leaf for path, leaf in nnx.to_flat_state(state)
            if str(path[0]) not in ("rng", "rngs")}


def _leaf_array(leaf: Any) -> Any:
    """The array of a state leaf: an nnx Variable's value, or the leaf itself."""
    if hasattr(leaf, "get_value"):
        return leaf.get_value()
    return leaf.value if hasattr(leaf, "value") else leaf


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one of the policy's weights goes in the engine's state, and how it must look there."""

    source: str               # layers.0.attn.q_proj.w
    target: str               # model.layers.0.self_attn.q_proj.kernel
    transpose: tuple[int, ...] | None


def map_names(source_names: list[str], family: str) -> tuple[list[Target], list[str]]:
    """(the engine-side target of each of `source_names` the family's vLLM-JAX map knows, the names it does not)."""
    names, transposes = family_mapping(family)
    patterns = [(_pattern(src), dst) for src, dst in names.items()]
    targets, unknown = [], []
    for source in source_names:
        for pattern, dst in patterns:
            match = pattern.match(source)
            if match is None:
                continue
            target = dst.replace("*", match.group(1)) if match.groups() else dst
            axes = next((axes for key, axes in transposes.items() if key in source or key in target), None)
            targets.append(Target(source, target, axes))
            break
        else:
            unknown.append(source)
    return targets, unknown


def plan_targets(source_names: list[str], state: Any, family: str) -> list[Target]:
    """The target of every name in `source_names` (the policy's parameter names) in the engine's `state`. A source
    name the map does not know, a target the state lacks, or a state leaf no source fills is an error naming it."""
    targets, unknown = map_names(source_names, family)
    flat = flat_state(state)
    absent = [f"{t.source} -> {t.target}" for t in targets if t.target not in flat]
    if unknown:
        raise VllmTpuWeightError(f"the {family} vLLM-JAX name map has no entry for {', '.join(unknown[:5])}"
                                 f"{' and more' if len(unknown) > 5 else ''}: a model of another shape or family")
    if absent:
        raise VllmTpuWeightError(f"the engine's state has no {', '.join(absent[:5])}"
                                 f"{' and more' if len(absent) > 5 else ''}: the engine was built for another model")
    unfilled = sorted(set(flat) - {t.target for t in targets})
    if unfilled:
        raise VllmTpuWeightError(f"no weight of the version fills the engine's {', '.join(unfilled[:5])}"
                                 f"{' and more' if len(unfilled) > 5 else ''}: it would keep its dummy values")
    return targets


def fitted(source: str, x: Any, like: Any, transpose: tuple[int, ...] | None) -> Any:
    """`x` in the engine's layout of `like`: transposed when the map says so and the shapes ask for it, KV heads
    repeated when the engine keeps a multiple of them, cast to the engine's dtype; anything else is an error."""
    shape = tuple(like.shape)
    if transpose is not None and tuple(x.shape) != shape and tuple(np.shape(x)[i] for i in transpose) == shape:
        x = jnp.transpose(x, transpose)
    if tuple(x.shape) != shape and len(x.shape) == len(shape) and KV_NAME.search(source):
        # K/V heads (never the last axis, the head dimension) repeated to the engine's count: each query head then
        # meets the same K/V values as in the model; anything else that differs (a padded head dimension) is refused
        differ = [i for i, (a, b) in enumerate(zip(x.shape, shape)) if a != b]
        if len(differ) == 1 and differ[0] != len(shape) - 1 and shape[differ[0]] % x.shape[differ[0]] == 0:
            x = jnp.repeat(x, shape[differ[0]] // x.shape[differ[0]], axis=differ[0])
    if tuple(x.shape) != shape:
        raise VllmTpuWeightError(f"{source}: shape {list(np.shape(x))} does not fit the engine's {list(shape)}")
    return x.astype(like.dtype)


class VllmTpuWeightWriter:
    """Installs versions into one in-process vllm-tpu engine; keeps the installed version and its cache salt."""

    def __init__(self, llm: Any, family: str, source_names: list[str]):
        self.llm, self.runner = llm, model_runner(llm)
        self.targets = plan_targets(source_names, self.runner.state, family)
        self.version: int | None = None
        self.epoch: str | None = None

    @property
    def cache_salt(self) -> str | None:
        """The prefix-cache salt of every request generated with the installed version."""
        return None if self.version is None else f"{self.epoch}:{self.version}"

    def install(self, named: dict[str, Any], version: int, epoch: str, keep_kv: bool = False) -> None:
        """Write `named` (the policy's name -> array) into the engine as `version` of trainer `epoch`. `keep_kv`: live
        requests keep their KV cache (in-flight updates, the scheduler paused with its requests kept): the cache is
        neither freed nor rebuilt, so one leaf's old and new copies are the most held at once beside it."""
        missing = [t.source for t in self.targets if t.source not in named]
        if missing:
            raise VersionRefused(f"version {version} lacks {', '.join(missing[:5])}: not a whole version")
        flat = flat_state(self.runner.state)
        try:
            for t in self.targets:  # every weight checked before the engine is touched: never half a version
                like = _leaf_array(flat[t.target])
                jax.eval_shape(lambda x, t=t, like=like: fitted(t.source, x, like, t.transpose),
                               jax.ShapeDtypeStruct(np.shape(named[t.source]), named[t.source].dtype))
        except VllmTpuWeightError as exc:
            raise VersionRefused(str(exc)) from None
        self.llm.reset_prefix_cache()  # refused while requests hold blocks (keep_kv): the version's salt covers that
        if not keep_kv:
            self.llm.collective_rpc("delete_kv_cache")
        jax.effects_barrier()
        for t in self.targets:
            leaf = flat[t.target]
            old = _leaf_array(leaf)
            new = jax.device_put(fitted(t.source, named[t.source], old, t.transpose), old.sharding)
            if hasattr(leaf, "set_value"):
                leaf.set_value(new)
            elif hasattr(leaf, "value"):
                leaf.value = new
            else:
                _set_path(self.runner.state, t.target.split("."), new)
            old.delete()  # the engine's old copy goes now, not when Python next collects
        if hasattr(self.runner, "state_leaves"):
            self.runner.state_leaves = tuple(jax.tree_util.tree_leaves(self.runner.state))
        if not keep_kv:
            self.llm.collective_rpc("reinitialize_kv_cache")
        self.version, self.epoch = version, epoch


def _set_path(state: Any, keys: list[str], value: Any) -> None:
    """state[k0][k1]... = value, for a flat name's keys (list indices come back from the name as strings)."""
    node = state
    for i, key in enumerate(keys):
        if key not in node and key.isdigit():
            key = int(key)
        if i == len(keys) - 1:
            node[key] = value
        else:
            node = node[key]
