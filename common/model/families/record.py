"""The typed record of a model family, and `Architecture`, the model config every record's parser produces.

A `ModelFamily` holds all that grpo-stream knows of one family: how its Hugging Face `config.json` maps to an
`Architecture` and back, its parameter names on both sides, how the sampler's decode forward re-lays its weights,
whether the trainer can rematerialise it, the Tunix patches its model code needs, and whether vLLM and vLLM-TPU can
serve it. The modules that act on that knowledge (architectures, hf_checkpoint, policy, remat_policy,
activation_sharding, engine/decode, engine/vllm_tpu) read it from the record, so a family is added by writing one
record (ARCHITECTURE.md, "Adding a model family").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from grpo_stream.common.registry.base import Registry


class ArchitectureError(ValueError):
    """A checkpoint's config that grpo-stream cannot run, phrased with the field and the fix."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    family: str                  # ModelFamily.family: llama3 | qwen2 | qwen3 | gemma2 | gemma3
    vocab_size: int
    num_layers: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    tied_embeddings: bool
    rope_scaling: tuple = ()     # llama3 scaling as sorted (key, value) pairs; () = none
    max_position_embeddings: int = 32768
    # Gemma 2 only
    attn_softcap: float | None = None    # attention logits: cap * tanh(logits / cap)
    final_softcap: float | None = None   # output logits, the same
    sliding_window: int | None = None    # window of the layers marked sliding
    layer_types: tuple = ()              # per layer: "sliding_attention" | "full_attention"
    # Gemma 3 only
    rope_local_theta: float = 10000.0    # RoPE base of the sliding layers (rope_theta is the full layers')
    rope_linear_factor: float = 1.0      # full layers' linear RoPE scaling
    query_pre_attn_scalar: float = 0.0   # attention scale is query_pre_attn_scalar ** -0.5 (0: head_dim)

    @property
    def qkv_bias(self) -> bool:
        return family_named(self.family).decode.qkv_bias

    @property
    def qk_norm(self) -> bool:
        return family_named(self.family).decode.qk_norm


# Architecture.family -> its record: filled by the families package (families/__init__.py `FAMILIES`), which imports
# the family modules, which import this one; so the records are found here without importing them back.
_BY_FAMILY: Registry["ModelFamily"] = Registry("Architecture.family", "model family", {})


def register(families: "tuple[ModelFamily, ...]") -> None:
    """Make `families` known by their `family` name (family_named)."""
    for f in families:
        if f.family in _BY_FAMILY:
            raise ValueError(f"two model family records share the family name {f.family!r}")
        _BY_FAMILY[f.family] = f


def family_named(family: str) -> "ModelFamily":
    """The record of `Architecture.family` `family`; a ValueError lists the registered ones."""
    return _BY_FAMILY.lookup(family)


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A feature the family lacks, with the reason an error message gives the operator."""

    reason: str

    def __post_init__(self):
        if not self.reason.strip():
            raise ValueError("Unsupported needs a reason: the operator's error message is built from it")


# one Hugging Face rule: (HF tensor name regex, our name template filled from its groups, HF array -> our layout)
HfRule = tuple[str, str, Callable[[Any], Any]]


@dataclasses.dataclass(frozen=True)
class NameMap:
    """Hugging Face tensor names and [out, in] layouts <-> our parameter names (the Tunix module's paths)."""

    from_hf: Callable[[Architecture], list[HfRule]]          # every tensor of the family as config.json describes it
    to_hf: Callable[[Architecture, dict], dict]               # our named arrays -> HF-named arrays
    # tensors some families read in parts and assemble afterwards (Gemma's q, k, v -> Tunix's stacked einsums):
    # a regex of the pending names the rules produce, and the function that turns them into our parameters
    pending: str | None = None
    assemble: Callable[[dict, Architecture], dict] | None = None


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """What the sampler's decode forward (common/engine/decode.py) needs to re-lay the family's weights."""

    layout: str                  # "llama": RMSNorm(w), SiLU-gated MLP; "gemma": (1 + w) norms around attention and
    #                              MLP, tanh-GELU, embedding scaled by sqrt(embed_dim), soft caps
    qkv_bias: bool = False       # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False        # q and k normalised per head before RoPE (Qwen3, Gemma 3)
    post_attn_norm: str = ""     # gemma layout: the Tunix module name of the post-attention norm (Gemma 2 and 3 differ)
    per_layer_rope: bool = False  # sliding and full layers use different RoPE bases (Gemma 3)

    def __post_init__(self):
        if self.layout not in ("llama", "gemma"):
            raise ValueError(f"DecodeSpec.layout={self.layout!r}: decode.py implements 'llama' and 'gemma'")


# trainer.remat -> the member of the Tunix module's RematConfig: 'attention' recomputes each layer's attention block in
# the backward pass, 'full' the whole decoder layer; 'save_dots' is 'full' with remat_policy.py's checkpoint policy
TUNIX_REMAT_MEMBERS = {"attention": "BLOCK", "full": "DECODER", "save_dots": "DECODER"}


@dataclasses.dataclass(frozen=True)
class RematSupport:
    """The family's Tunix ModelConfig has a rematerialisation switch: `field`, an enum `RematConfig` of the module."""

    members: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(TUNIX_REMAT_MEMBERS))
    field: str = "remat_config"


@dataclasses.dataclass(frozen=True)
class TunixPatches:
    """The runtime patches of the pinned Tunix (0.1.7) the family's model code needs. Each replaces a module
    attribute once per process and acts only while a model is traced inside its hook; outside, Tunix runs as shipped.

    rope           `architectures.rope_of`: the module's `apply_rope` ignores rope_theta and Llama 3.1 scaling
    shard_modules  `activation_sharding.activation_sharding`: these modules' `shard()` apply their constraints only
                   inside the deprecated `with mesh:` and never on CPU
    remat_policy   `remat_policy.remat_policy_of`: the module's `nnx.remat` takes no checkpoint policy (save_dots)
    """

    rope: bool = False
    shard_modules: tuple[str, ...] = ()
    remat_policy: bool = False

    def hooks(self) -> tuple[str, ...]:
        return tuple(name for name, used in (("rope_of", self.rope), ("activation_sharding", bool(self.shard_modules)),
                                             ("remat_policy_of", self.remat_policy)) if used)


@dataclasses.dataclass(frozen=True)
class VllmSupport:
    """vLLM (GPU) builds the model class `architecture` names from the exported config.json and loads Hugging Face
    names (`NameMap.to_hf`) through its `load_weights`."""

    architecture: str


@dataclasses.dataclass(frozen=True)
class VllmTpuSupport:
    """vllm-tpu (tpu-inference) holds the model as an nnx State: `mapping_module`'s VLLM_JAX_MAPPING (shipped with
    Tunix) maps our names to it (common/engine/vllm_tpu.py)."""

    mapping_module: str


@dataclasses.dataclass(frozen=True, eq=False)
class ModelFamily:
    """Everything grpo-stream knows of one model family (one per Hugging Face `architectures` name)."""

    family: str                   # Architecture.family, our short name
    hf_architecture: str          # config.json `architectures[0]`: the registry's key, what export writes
    hf_model_type: str            # config.json `model_type`: what transformers (and from_hf_config) dispatch on
    parse_hf_config: Callable[[dict, str], Architecture]  # config.json -> Architecture; refuses with the field named
    hf_config_fields: Callable[[Architecture], dict]      # the family's config.json fields beyond the shared shapes
    tunix_module: str             # the Tunix module of the model code
    tunix_class: str              # its nnx.Module class
    tunix_config: Callable[[Architecture, Any], Any]      # (arch, dtype) -> the module's ModelConfig
    names: NameMap
    decode: DecodeSpec
    remat: RematSupport | Unsupported
    tunix_patches: TunixPatches
    vllm: VllmSupport | Unsupported
    vllm_tpu: VllmTpuSupport | Unsupported
    # a small config.json of the family (hidden 64, a few layers): the family tests build their random-init model from
    # it, so a registered family is covered by every feature test without further edits
    tiny_hf_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        save_dots = isinstance(self.remat, RematSupport) and "save_dots" in self.remat.members
        if save_dots and not self.tunix_patches.remat_policy:
            raise ValueError(f"{self.family}: save_dots needs the remat_policy patch (TunixPatches.remat_policy=True)")


def field(config: dict, key: str, where: str, kind: Callable = int, default: Any = None) -> Any:
    """config[key] as `kind` (default when absent or null, as transformers' config classes take a null); a missing or
    mistyped value is an ArchitectureError naming it."""
    value = config.get(key)
    value = default if value is None else value
    if value is None:
        raise ArchitectureError(f"{where}: field '{key}' is missing")
    if kind is int:
        # every int field is a size: int(64.7), int("64") or int(true) would pass a config transformers refuses
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArchitectureError(f"{where}: field '{key}'={value!r} is not a positive integer")
        return value
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ArchitectureError(f"{where}: field '{key}'={value!r} is not a {kind.__name__}") from None


def flag(config: dict, key: str, where: str, default: bool) -> bool:
    """config[key] as a JSON boolean (`default` when absent or null): bool("false") is True, which would tie an
    untied model's head to its embedding and drop its lm_head.weight unsaid."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ArchitectureError(f"{where}: field '{key}'={value!r} is not a JSON boolean (true or false)")
    return value


def mapping(config: dict, key: str, where: str) -> dict:
    """config[key] as a JSON object ({} when absent or null): a RoPE setting of another type would fail on `.get`
    naming no field."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ArchitectureError(f"{where}: field '{key}'={value!r} is not a JSON object")
    return value


def check_heads(arch: Architecture, where: str) -> Architecture:
    """`arch`, once its KV heads are known to divide its query heads (grouped-query attention shares each KV head
    among num_heads / num_kv_heads query heads; the model code's reshape would fail naming no field)."""
    if arch.num_kv_heads < 1 or arch.num_heads % arch.num_kv_heads:
        raise ArchitectureError(f"{where}: num_key_value_heads={arch.num_kv_heads} must divide "
                                f"num_attention_heads={arch.num_heads}")
    return arch


def rope_theta(config: dict, where: str) -> float:
    # transformers 5 moved the base into rope_parameters (for which an older config's rope_scaling stands), older
    # configs have rope_theta at the top; as in transformers, a base in that object wins over the top-level one
    params = mapping(config, "rope_scaling", where) or mapping(config, "rope_parameters", where)
    return field({"rope_theta": params.get("rope_theta", config.get("rope_theta"))}, "rope_theta", where, float)
