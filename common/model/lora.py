"""LoRA (model.lora): low-rank adapters on the policy's projections, added by qwix, the library Tunix uses.

qwix intercepts the matrix products of the modules `targets` matches and gives each weight W two new parameters,
A (its input side and the rank) and B (the rank and its output side): the module then computes
x W + (alpha / rank) (x A) B. B starts at zero, so the adapted model starts equal to the base.

The trainer trains A and B only (`LoraPolicy.trainable`): the optimizer holds moments for the adapters, not for
the base. Everything else in the system keeps running the plain model with the merged weights W + (alpha / rank) A B,
so neither engine (JAX or vLLM) needs to know about adapters: the trainer merges for evaluation and export
(`LoraPolicy.merged`); the samplers receive the frozen base once and the adapters with every version, and merge them
with the same function (`merge_named`), so both sides hold the same weights. Merging rounds once more than the
adapted forward pass does; in float32 the trainer's and samplers' logprobs agree to ~1e-7 on average.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_stream.common.config.learning import LORA_DEFAULT_TARGETS, LoraSection
from grpo_stream.common.model import architectures
from grpo_stream.common.model.policy import PolicyModel, causal_mask
from grpo_stream.protos import weights_pb2

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")


def is_adapter(name: str) -> bool:
    """True for an adapter parameter's name (layers.0.attn.q_proj.w_lora_a), False for a base weight's."""
    return name.endswith(ADAPTER_SUFFIXES)


@dataclasses.dataclass(frozen=True)
class AdaptedWeight:
    """One base weight with its two adapters, and the einsum that turns A and B into a delta of W's layout."""

    weight: str   # layers.0.attn.q_proj.w
    a: str        # layers.0.attn.q_proj.w_lora_a
    b: str        # layers.0.attn.q_proj.w_lora_b
    spec: str     # e.g. 'Dr,rNH->DNH' for q_proj's 'BTD,DNH->BTNH'


@dataclasses.dataclass(frozen=True)
class LoraPolicy:
    """The adapted model (what the trainer differentiates) beside the plain one (what everything else runs)."""

    base: PolicyModel      # the plain model: its graph, and its names for the merged weights
    adapted: PolicyModel   # the graph with adapters; its params hold the base weights and the adapters
    weights: tuple[AdaptedWeight, ...]
    rank: int
    scale: float           # alpha / rank

    def trainable(self) -> tuple[bool, ...]:
        """Per leaf of the adapted params (flattened order): True for the adapters."""
        return tuple(is_adapter(name) for name in self.adapted.names())

    def merged(self, params: Any) -> Any:
        """The plain model's params from the adapted model's `params`: W + scale * delta(A, B) for each adapted
        weight, the other weights as they are. Traceable (jit it for placed arrays)."""
        base, adapters = self.split_named(params)
        return self.base.params_from_arrays(merge_named(base, adapters, self.weights, self.scale))

    def split_named(self, params: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """(frozen base weights under the plain model's names, adapters by name) of the adapted `params`."""
        named = self.adapted.named_arrays(params)
        return ({name: named[name] for name in self.base.names()},
                {name: x for name, x in named.items() if is_adapter(name)})

    def adapter_version(self):
        """The merge a sampler applies to each adapters-only version (the publisher fills in the base)."""
        return weights_pb2.AdapterVersion(scale=self.scale, merges=[
            weights_pb2.LoraMerge(weight=w.weight, a=w.a, b=w.b, spec=w.spec) for w in self.weights])

    def adapter_count(self) -> int:
        """Parameters the adapters add (what the optimizer holds moments for)."""
        return sum(int(leaf.size) for name, leaf in self.adapted.named_arrays().items() if is_adapter(name))


def merge_named(base: dict[str, Any], adapters: dict[str, Any], weights, scale: float) -> dict[str, Any]:
    """`base` (name -> weight) with W + scale * einsum(spec, A, B) for each of `weights` (AdaptedWeight or any
    object with .weight, .a, .b, .spec), computed in float32 and rounded once to W's dtype: the trainer's merge
    and a sampler's merge of the same arrays give the same weights. Traceable."""
    out = dict(base)
    for w in weights:
        weight = base[w.weight]
        delta = jnp.einsum(w.spec, adapters[w.a].astype(jnp.float32), adapters[w.b].astype(jnp.float32))
        out[w.weight] = (weight.astype(jnp.float32) + scale * delta).astype(weight.dtype)
    return out


def apply_lora(model: PolicyModel, params: Any, section: LoraSection, seed: int) -> LoraPolicy:
    """`model` with adapters on the weights of the modules `section.targets` matches, built around `params` (the
    base weights, placed; the adapters take their shardings from the weights they adapt). A is initialised from
    `seed`, B at zero. qwix finds the products to adapt by running the model once on a two-token input."""
    import qwix  # noqa: PLC0415 - deferred: only LoRA runs need it

    module = nnx.merge(model.graphdef, params)
    provider = qwix.LoraProvider(module_path=section.targets, rank=section.rank, alpha=section.alpha)
    tokens = jnp.zeros((1, 2), jnp.int32)
    valid = jnp.ones((1, 2), jnp.bool_)
    with architectures.rope_of(model.arch):
        adapted_module = qwix.apply_lora_to_model(module, provider, tokens, jnp.arange(2)[None], None,
                                                  causal_mask(valid), rngs=nnx.Rngs(seed))
    graphdef, adapted_params = nnx.split(adapted_module)
    adapted = dataclasses.replace(model, graphdef=graphdef, params=adapted_params)
    weights = _adapted_weights(adapted_module, section.rank)
    if not weights:
        # the family's own paths: Gemma's attention is q_einsum / kv_einsum / attn_vec_einsum, not q_proj ...
        raise ValueError(f"model.lora.targets={section.targets!r} matched no projection of the {model.arch.family} "
                         f"model; its module paths are {_paths_listed(module)}: match some of them, or leave "
                         "model.lora.targets unset for the default (grpo-stream config describe model)")
    _check_every_part_adapts(section.targets, weights, module, model.arch.family)
    adapted = dataclasses.replace(adapted, params=_placed_like_weights(adapted, weights))
    return LoraPolicy(base=model, adapted=adapted, weights=tuple(weights), rank=section.rank,
                      scale=section.alpha / section.rank)


def adapter_shardings(adapted: PolicyModel, weights, named: dict[str, Any] | None = None) -> dict[str, Any]:
    """adapter name -> its place on the mesh of the weight it adapts: A split as the weight's input side is, B as its
    output side, the rank never. Weights that are not on a mesh give nothing. `named`: name -> the weights (arrays
    or abstract arrays with shardings); default the adapted model's own."""
    named = adapted.named_arrays() if named is None else named
    out = {}
    for w in weights:
        sharding = getattr(named[w.weight], "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            continue
        inputs, letters = w.spec.split("->")
        spec = tuple(sharding.spec) + (None,) * (len(letters) - len(sharding.spec))
        axis_of = dict(zip(letters, spec))
        for name, operand in zip((w.a, w.b), inputs.split(",")):
            out[name] = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
                *(axis_of.get(c) for c in operand)))
    return out


def _placed_like_weights(adapted: PolicyModel, weights: list[AdaptedWeight]) -> Any:
    """The adapted params with each adapter on its weight's mesh (`adapter_shardings`). qwix leaves them on one device
    when the weights are sharded, and the update step, which returns them on the mesh, would then compile a second
    time for its second call."""
    named = adapted.named_arrays()
    for name, target in adapter_shardings(adapted, weights, named).items():
        named[name] = jax.device_put(named[name], target)
    return adapted.params_from_arrays(named)


def abstract_lora(model: PolicyModel, section: LoraSection, seed: int) -> LoraPolicy:
    """`apply_lora` for a model whose params are abstract (shapes, dtypes and shardings, as `grpo-stream plan` builds
    them): the adapted params come back abstract too, each adapter with its weight's sharding; nothing is
    allocated."""
    built = {}

    def adapted_params(params):
        built["policy"] = apply_lora(model, params, section, seed)
        return built["policy"].adapted.params

    shapes = jax.eval_shape(adapted_params, model.params)
    policy = built["policy"]
    adapted = dataclasses.replace(policy.adapted, params=shapes)
    named = {**adapted.named_arrays(), **model.named_arrays()}  # the base weights keep their shardings
    placed = adapter_shardings(adapted, policy.weights, named)
    named = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed.get(name, getattr(x, "sharding", None)))
             for name, x in named.items()}
    return dataclasses.replace(policy, adapted=dataclasses.replace(adapted, params=adapted.params_from_arrays(named)))


def _adapted_weights(module: nnx.Module, rank: int) -> list[AdaptedWeight]:
    """Every adapted weight of `module`, with the einsum that rebuilds its delta from A and B: qwix records the
    adapted einsum of an Einsum module ('BTD,Dr,rNH->BTNH'), whose operands' letters give the weight's own order;
    a Linear kernel [in, out] takes A [in, r] @ B [r, out]."""
    out = []
    for path, node in nnx.iter_graph(module):
        if not isinstance(node, nnx.Module):
            continue
        prefix = ".".join(str(p) for p in path)
        for attr in sorted(vars(node)):
            if not attr.endswith("_lora_a"):
                continue
            weight = attr.removesuffix("_lora_a")
            w = getattr(node, weight)
            names = [f"{prefix}.{n}" if prefix else n for n in (weight, attr, weight + "_lora_b")]
            lora_str = getattr(node, weight + "_lora_einsum_str", None)
            if lora_str is not None:
                spec = _einsum_delta(node.einsum_str, lora_str)
            elif w.ndim == 2:
                spec = "ir,ro->io"
            else:
                raise ValueError(f"model.lora.targets: {prefix}.{weight} is a {w.ndim}-d weight used by a product "
                                 "this merge does not know; leave that module out of the targets")
            shape = jax.eval_shape(lambda a, b, s=spec: jnp.einsum(s, a, b), getattr(node, attr),
                                   getattr(node, weight + "_lora_b")).shape
            if tuple(shape) != tuple(w.shape):
                raise ValueError(f"model.lora: {prefix}.{weight}: adapters of rank {rank} give a delta of shape "
                                 f"{list(shape)} for a weight of {list(w.shape)}; leave that module out of "
                                 "model.lora.targets")
            out.append(AdaptedWeight(*names, spec=spec))
    return out


def _projection_paths(module: nnx.Module, prefix: str) -> list[str]:
    """Paths under `prefix` of the modules holding a matrix (or higher) parameter: what model.lora.targets can match."""
    out = []
    for path, node in nnx.iter_graph(module):
        name = "/".join(str(p) for p in path)
        if isinstance(node, nnx.Module) and name.startswith(prefix) and any(
                isinstance(v, nnx.Param) and len(v.shape) >= 2 for v in vars(node).values()):
            out.append(name)
    return sorted(out)


def _paths_listed(module: nnx.Module) -> str:
    """The module paths a target can match, for errors: layer 0's (every layer has the same) and those outside the
    layers (the output head, and an embedding table, which takes no adapter)."""
    outside = [p for p in _projection_paths(module, "") if not p.startswith("layers/")]
    listed = f"{', '.join(_projection_paths(module, 'layers/0/'))} (and the same for every layer)"
    if outside:
        listed += f", and outside the layers {', '.join(outside)} (an embedding table takes no adapter)"
    return listed


def _check_every_part_adapts(targets: str, weights: list[AdaptedWeight], module: nnx.Module, family: str) -> None:
    """Refuse a pattern of the user's own one of whose alternatives ('.*/(q_proj|v_prj)': 'v_prj') adapts nothing: the
    others' adapters were trained and the misspelt (or absent) module silently went without. The default names every
    family's projections, so each family lacks some of its alternatives: it is not checked."""
    if targets == LORA_DEFAULT_TARGETS:
        return
    adapted = {w.weight.rsplit(".", 1)[0].replace(".", "/") for w in weights}  # qwix's module paths
    for part, pattern in _alternatives(targets):
        try:
            matches = any(re.fullmatch(pattern, path) for path in adapted)
        except re.error:  # a part that is no pattern alone (a back-reference, a flag): nothing to say of it
            continue
        if not matches:
            raise ValueError(f"model.lora.targets={targets!r}: its part {part!r} adapts nothing in the {family} model "
                             f"(no adapted projection's path matches {pattern!r} in full); the module paths are "
                             f"{_paths_listed(module)}: correct that part or remove it")


def _alternatives(pattern: str) -> list[tuple[str, str]]:
    """(part, the pattern with that part alone) for each alternative of `pattern`'s top level ('a|b'), or else of its
    one top-level group holding alternatives ('.*/(a|b)': '.*/(?:a)', '.*/(?:b)'); [] for a pattern with neither."""
    marks = _regex_marks(pattern)
    bars = [i for i, c, depth in marks if c == "|" and depth == 0]
    if bars:
        return [(p, p) for p in _split_at(pattern, bars)]
    opens = [i for i, c, depth in marks if c == "(" and depth == 0]
    closes = [i for i, c, depth in marks if c == ")" and depth == 0]
    groups = []
    for start, end in zip(opens, closes):
        inner = [i for i, c, depth in marks if c == "|" and depth == 1 and start < i < end]
        if inner:
            groups.append((start, end, inner))
    if len(groups) != 1:
        return []  # several groups of alternatives: not split
    start, end, inner = groups[0]
    opener = pattern[start + 1:start + 3]
    if opener.startswith("?") and opener != "?:":
        return []  # a lookaround or a named group: not split
    body = start + (3 if opener == "?:" else 1)
    parts = _split_at(pattern[:end], inner)
    parts[0] = parts[0][body:]
    return [(p, f"{pattern[:start]}(?:{p}){pattern[end + 1:]}") for p in parts]


def _split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [-1, *cuts, len(text)]
    return [text[a + 1:b] for a, b in zip(bounds, bounds[1:])]


def _regex_marks(pattern: str) -> list[tuple[int, str, int]]:
    """(index, char, group depth outside it) of each '(', ')' and '|' of `pattern` that is not escaped or in a
    character class."""
    out, depth, i, in_class = [], 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 + (pattern[i + 1:i + 2] == "^")
            i += pattern[i:i + 1] == "]"  # a ']' first in a class is a literal
            continue
        elif c == "(":
            out.append((i, c, depth))
            depth += 1
        elif c == ")":
            depth -= 1
            out.append((i, c, depth))
        elif c == "|":
            out.append((i, c, depth))
        i += 1
    return out


def _einsum_delta(einsum_str: str, lora_str: str) -> str:
    """'Dr,rNH->DNH' from the module's 'BTD,DNH->BTNH' and qwix's 'BTD,Dr,rNH->BTNH'."""
    rhs = einsum_str.split("->")[0].split(",")[1]
    _, a, b = lora_str.split("->")[0].split(",")
    return f"{a},{b}->{rhs}"
