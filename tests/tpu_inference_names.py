"""tpu-inference's own JAX models built abstractly on CPU: their nnx state tree, name -> [shape, dtype].

Not a test (no pytest here): a probe run by hand in an environment that has tpu-inference 0.32.0, vllm-tpu 0.32.0
(its source tree on the path is enough), jax/jaxlib 0.11.2, flax 0.12.10 and torch 2.10 (see /work/tpuenv/REPORT.md):

    JAX_PLATFORMS=cpu /work/tpuenv/venv/bin/python -m tests.tpu_inference_names OUT.json

For each family (llama3, qwen2, qwen3) the model class tpu-inference registers for it is built with
`nnx.eval_shape` under a mesh, as its model loader does before loading weights, and `nnx.state(model)` (what the
runner keeps as `model_runner.state`) is flattened to dotted names. Each family is built with tensor parallelism 1
and, as "<family>@tp4", over 4 fake CPU devices, to show any head padding. A build that fails gets
{"error": "<exception>", "traceback": [...]} instead. Qwen2ForCausalLM with untied embeddings reads
`hf_config.text_config`, which a plain Qwen2Config lacks, so Qwen2 is also built as "qwen2[text_config]" with
`text_config` set to the config itself (the attribute its code falls back from). The vLLM config is a stand-in
holding only the fields these constructors read.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from types import SimpleNamespace

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

# a tiny config of each family: 2 layers, hidden 64, 4 heads, 2 KV heads, head_dim 16, vocab 128, MLP 128
TINY = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=128, intermediate_size=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
FAMILIES = {  # family -> (transformers config class, tpu-inference module, model class)
    "llama3": ("LlamaConfig", "llama3", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "qwen3", "Qwen3ForCausalLM"),
}


def vllm_config_for(hf_config, tp: int):
    """The fields of vLLM's VllmConfig that the three model constructors (and the quant-config lookup) read."""
    import jax.numpy as jnp
    from tpu_inference.layers.jax.quantization import get_tpu_quantization_config

    model_config = SimpleNamespace(hf_config=hf_config, dtype=jnp.bfloat16, quantization=None, runner_type="generate",
                                   get_vocab_size=lambda: hf_config.vocab_size)
    config = SimpleNamespace(model_config=model_config, cache_config=SimpleNamespace(cache_dtype="auto"),
                             parallel_config=SimpleNamespace(tensor_parallel_size=tp), speculative_config=None,
                             load_config=SimpleNamespace(load_format="dummy"))
    config.quant_config = get_tpu_quantization_config(config)  # UnquantizedConfig, as get_flax_model sets it
    return config


def state_names(family: str, tp: int, text_config: bool = False) -> dict[str, list]:
    import importlib

    import jax
    import numpy as np
    import transformers
    from flax import nnx
    from tpu_inference.distributed import jax_parallel_state

    config_cls, module, cls_name = FAMILIES[family]
    hf_config = getattr(transformers, config_cls)(**TINY, architectures=[cls_name])
    if text_config:
        hf_config.text_config = hf_config
    model_cls = getattr(importlib.import_module(f"tpu_inference.models.jax.{module}"), cls_name)
    # one pipeline stage (the worker sets this up before loading a model)
    jax_parallel_state.init_pp_distributed_environment(ip="", rank=0, world_size=1, device=None, need_pp=False)
    # the runner's 2-D ("data", "model") mesh; tensor parallelism on "model"
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), ("data", "model"))
    vllm_config = vllm_config_for(hf_config, tp)
    with jax.set_mesh(mesh):  # as model_loader._get_nnx_model does for the abstract model
        model = nnx.eval_shape(lambda: model_cls(vllm_config, jax.random.key(0), mesh), graph_updates=False)
    flat = nnx.to_flat_state(nnx.state(model))
    out = {}
    for path, leaf in flat:
        value = leaf.get_value() if hasattr(leaf, "get_value") else leaf
        out[".".join(str(k) for k in path)] = [list(value.shape), str(value.dtype)]
    return out


def main(path: str) -> None:
    runs = [(family, tp, False) for family in FAMILIES for tp in (1, 4)] + [("qwen2", 1, True), ("qwen2", 4, True)]
    result = {}
    for family, tp, text_config in runs:
        key = family + ("[text_config]" if text_config else "") + ("" if tp == 1 else f"@tp{tp}")
        try:
            result[key] = state_names(family, tp, text_config)
        except Exception as e:  # noqa: BLE001 - the probe reports what failed, per build
            result[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc().splitlines()[-12:]}
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    for key, names in result.items():
        print(key, "ERROR " + names["error"] if "error" in names else f"{len(names)} leaves")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tpu_inference_names.json")
