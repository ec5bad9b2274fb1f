"""Hugging Face checkpoints: tiny random models made with `transformers` load into our JAX model with the same
logits (float32, 1e-4), multi-file bfloat16 checkpoints load, export round-trips, bad checkpoints are named."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_stream.common.engine import decode
from grpo_stream.common.model.architectures import ArchitectureError, from_hf_config
from grpo_stream.common.model.hf_checkpoint import (CheckpointError, export_hf, read_architecture, read_safetensors,
                                                   write_safetensors)
from grpo_stream.common.model.policy import causal_mask, load_hf_model, positions_from_mask

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256)
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
FAMILIES = {
    # name: (config class, extra config)
    "llama3.1-untied": ("LlamaConfig", dict(tie_word_embeddings=False, rope_parameters=LLAMA31_ROPE)),
    "llama3.2-tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                      "rope_theta": 500000.0})),
    "qwen2.5-tied": ("Qwen2Config", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 1000000.0})),
    "qwen2-untied": ("Qwen2Config", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                      "rope_theta": 10000.0})),
    "qwen3-untied": ("Qwen3Config", dict(tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                                                      "rope_theta": 1000000.0})),
    "qwen3-tied-5e6": ("Qwen3Config", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 5000000.0})),
    "gemma2-gqa": ("Gemma2Config", dict(query_pre_attn_scalar=16, sliding_window=4096, attn_logit_softcapping=50.0,
                                        final_logit_softcapping=30.0, attn_implementation="eager",
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gemma2-mha": ("Gemma2Config", dict(query_pre_attn_scalar=16, sliding_window=4096, attn_logit_softcapping=50.0,
                                        final_logit_softcapping=30.0, attn_implementation="eager",
                                        num_key_value_heads=4,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "gemma3-gqa": ("Gemma3TextConfig", dict(
        num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=4096, attn_implementation="eager",
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def make_hf_model(directory: pathlib.Path, family: str, seed: int, dtype=None, max_shard_size=None):
    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**{**SHAPE, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random norms and biases too, so a mis-mapped one cannot hide behind ones/zeros
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p) + (1.0 if "norm" in name and "gemma" not in family else 0.0))
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def our_logits(model, tokens: np.ndarray) -> np.ndarray:
    valid = jnp.ones(tokens.shape, jnp.bool_)
    logits, _ = model.apply(model.params, jnp.asarray(tokens), positions_from_mask(valid), None, causal_mask(valid))
    return np.asarray(logits, np.float32)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    seed = np.random.randint(1 << 30)
    hf = make_hf_model(tmp_path, family, seed)
    ours = load_hf_model(str(tmp_path), "float32")
    assert ours.arch.tied_embeddings == FAMILIES[family][1].get("tie_word_embeddings", True)
    tokens = np.random.default_rng(seed).integers(0, SHAPE["vocab_size"], (2, 40))
    want = hf_logits(hf, tokens)
    np.testing.assert_allclose(our_logits(ours, tokens), want, atol=1e-4, rtol=1e-4)
    # the sampler's decode forward (prefill) is the same function
    w = decode.decode_weights(ours, ours.params)
    valid = jnp.ones(tokens.shape, jnp.bool_)
    got, _ = decode.forward(ours, w, jnp.asarray(tokens), positions_from_mask(valid),
                            decode.init_cache(ours, 2, 40), 0, causal_mask(valid))
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


def test_multi_file_bfloat16_checkpoint_loads(tmp_path):
    hf = make_hf_model(tmp_path, "llama3.1-untied", 0, dtype=torch.bfloat16, max_shard_size="100KB")
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (2, 24))
    in_bf16 = load_hf_model(str(tmp_path), "bfloat16")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(in_bf16.params))
    # the same bf16 weights computed in float32 on both sides agree to float32 precision
    in_f32 = load_hf_model(str(tmp_path), "float32")
    np.testing.assert_allclose(our_logits(in_f32, tokens), hf_logits(hf.float(), tokens), atol=1e-4, rtol=1e-4)
    # computed in bfloat16, within bfloat16 rounding of the float32 result
    np.testing.assert_allclose(our_logits(in_bf16, tokens), our_logits(in_f32, tokens), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("family", ["qwen2.5-tied", "llama3.1-untied", "gemma2-gqa", "gemma2-mha", "gemma3-gqa"])
def test_export_round_trips_through_transformers(tmp_path, family):
    original = make_hf_model(tmp_path / "in", family, 1)
    ours = load_hf_model(str(tmp_path / "in"), "float32")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"bos_token_id": 90}))  # the source's own BOS
    out = export_hf(tmp_path / "out", ours.arch, ours.to_named_numpy(), tokenizer_dir=tmp_path / "tok",
                    eos_ids=[1, 2], pad_id=0)
    assert (out / "tokenizer_config.json").exists()
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == 90  # not the config class's default
    # the run's stop tokens travel with the export, so `generate` stops where the sampler did
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [1, 2]
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [1, 2], "pad_token_id": 0}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.random.default_rng(1).integers(0, SHAPE["vocab_size"], (2, 30))
    # export -> transformers: the same weights in transformers give the original checkpoint's logits (1e-5)
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(original, tokens), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(hf_logits(reloaded, tokens), our_logits(ours, tokens), atol=1e-4, rtol=1e-4)
    again = load_hf_model(str(out), "float32")
    for name, value in ours.to_named_numpy().items():
        np.testing.assert_array_equal(again.to_named_numpy()[name], value)


def test_an_export_into_a_directory_holding_a_sharded_checkpoint_replaces_it(tmp_path):
    """Exporting where a sharded save already was left its index and shards: transformers read the new
    model.safetensors, but this reader (and vLLM, which loads what an index names) the old weights, silently."""
    old = make_hf_model(tmp_path / "out", "qwen2.5-tied", 1, max_shard_size="100KB")
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    make_hf_model(tmp_path / "in", "qwen2.5-tied", 2)
    ours = load_hf_model(str(tmp_path / "in"), "float32")
    export_hf(tmp_path / "out", ours.arch, ours.to_named_numpy())
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    again = load_hf_model(str(tmp_path / "out"), "float32")
    for name, value in ours.to_named_numpy().items():
        np.testing.assert_array_equal(again.to_named_numpy()[name], value)
    tokens = np.random.default_rng(1).integers(0, SHAPE["vocab_size"], (1, 12))
    assert not np.allclose(hf_logits(old, tokens), our_logits(again, tokens), atol=1e-3)


def test_model_safetensors_is_read_before_an_index_beside_it_as_transformers_reads_it(tmp_path):
    make_hf_model(tmp_path / "m", "qwen2.5-tied", 1, max_shard_size="100KB")
    newer = make_hf_model(tmp_path / "single", "qwen2.5-tied", 2)
    (tmp_path / "single" / "model.safetensors").rename(tmp_path / "m" / "model.safetensors")
    ours = load_hf_model(str(tmp_path / "m"), "float32")
    tokens = np.random.default_rng(1).integers(0, SHAPE["vocab_size"], (1, 12))
    np.testing.assert_allclose(our_logits(ours, tokens), hf_logits(newer, tokens), atol=1e-4, rtol=1e-4)


def _rewrite(path: pathlib.Path, change) -> None:
    tensors = dict(read_safetensors(path))
    tensors = {k: np.array(v) for k, v in tensors.items()}
    change(tensors)
    write_safetensors(path, tensors)


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), r"tensors missing .*layers\.1\.mlp\.up_proj\.kernel"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight",
                             t["model.layers.0.self_attn.q_proj.weight"][:32]),
     r"tensor model\.layers\.0\.self_attn\.q_proj\.weight has shape \[32, 64\]; config\.json implies"),
    (lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", np.zeros(64, np.float32)),
     r"tensor model\.layers\.0\.self_attn\.q_proj\.bias: not part of a llama3 model"),
    (lambda t: t.__setitem__("model.layers.7.input_layernorm.weight", np.ones(64, np.float32)),
     r"tensor model\.layers\.7\.input_layernorm\.weight has no place .*num_hidden_layers=3"),
])
def test_bad_checkpoints_name_the_tensor(tmp_path, change, message):
    make_hf_model(tmp_path, "llama3.2-tied", 2)
    _rewrite(tmp_path / "model.safetensors", change)
    with pytest.raises(CheckpointError, match=message):
        load_hf_model(str(tmp_path), "float32")


def test_truncated_file_and_missing_config(tmp_path):
    make_hf_model(tmp_path, "qwen3-untied", 3)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: tensor .* corrupt|truncated"):
        load_hf_model(str(tmp_path), "float32")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="model.safetensors: not a safetensors file"):
        load_hf_model(str(tmp_path), "float32")
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf_model(str(tmp_path), "float32")


@pytest.mark.parametrize("edit, message", [
    ({"model_type": "gemma3"}, "model_type 'gemma3': multimodal Gemma 3 checkpoints are not supported"),
    ({"model_type": "gemma3_text", "head_dim": 16, "final_logit_softcapping": 30.0},
     "final_logit_softcapping=30.0; Tunix's Gemma 3 code supports only"),
    ({"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 144},
     "query_pre_attn_scalar=144; Tunix's Gemma 2 code fixes it to 16"),
    ({"model_type": "gemma2", "query_pre_attn_scalar": 16},
     "rope_theta=1000000.0; Tunix's Gemma 2 code fixes it to 10000.0"),
    # a field left out means transformers' default: 256 for Gemma 2's query_pre_attn_scalar, not head_dim
    ({"model_type": "gemma2", "head_dim": 16}, "query_pre_attn_scalar=256; Tunix's Gemma 2 code fixes it to 16"),
    # Gemma 3's layout from sliding_window_pattern, as transformers lays it out (2: sliding, full, ...), refused
    ({"model_type": "gemma3_text", "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window_pattern": 2,
      "tie_word_embeddings": True, "layer_types": None},
     "layer_types must be 5 sliding_attention layers then one full_attention"),
    ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "rope_scaling type 'yarn' is not supported for qwen3"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 must divide num_attention_heads=4"),
    ({"hidden_size": None}, "field 'hidden_size' is missing"),
    ({"use_sliding_window": True}, "use_sliding_window=true is not supported"),
])
def test_unsupported_configs_name_the_field(tmp_path, edit, message):
    make_hf_model(tmp_path, "qwen3-untied", 4)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(edit)
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ArchitectureError, match=message):
        from_hf_config(config, "config.json")


def test_gemma2_sequences_longer_than_the_sliding_window_are_refused(tmp_path):
    from grpo_stream.common.engine.continuous import ContinuousEngine

    cls_name, extra = FAMILIES["gemma2-gqa"]
    config = getattr(transformers, cls_name)(**{**SHAPE, **extra, "sliding_window": 32})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_hf_model(str(tmp_path), "float32")
    ContinuousEngine(model, pad_id=0, eos_id=1, max_prompt_tokens=16, max_new_tokens=16, temperature=1.0)  # 32 fits
    with pytest.raises(ValueError, match=r"max_new_tokens = 40 exceeds the model's sliding_window=32"):
        ContinuousEngine(model, pad_id=0, eos_id=1, max_prompt_tokens=24, max_new_tokens=16, temperature=1.0)


@pytest.mark.parametrize("family", ["llama3.1-untied", "qwen2.5-tied", "qwen3-tied-5e6", "gemma2-gqa", "gemma3-gqa"])
def test_engine_logprobs_equal_the_trainers_recomputation(tmp_path, family):
    """KV-cached sampling with the decode forward agrees with the training module on every family."""
    from grpo_stream.common.engine.continuous import ContinuousEngine
    from grpo_stream.common.model.policy import sequence_logprobs
    from grpo_stream.trainer_service.learning.batching import layout

    make_hf_model(tmp_path, family, 5)
    model = load_hf_model(str(tmp_path), "float32")
    p, c = 12, 10
    rng = np.random.default_rng()
    prompts = [rng.integers(2, SHAPE["vocab_size"], rng.integers(3, p + 1)).tolist() for _ in range(6)]
    for ragged in (True, False):  # the CPU kernel's attention over each slot's own positions, and XLA's dense one
        engine = ContinuousEngine(model, pad_id=0, eos_id=1, max_prompt_tokens=p, max_new_tokens=c, temperature=0.8,
                                  ragged_attention=ragged)
        out = engine.generate(model.params, prompts, jax.random.key(int(rng.integers(1 << 30))))
        assert {program[2] for program in engine.programs if program[0] == "decode"} == {ragged}
        rows = [layout(np.array(pr), out.tokens[i, :out.lengths[i]], p, c, 0) for i, pr in enumerate(prompts)]
        tokens, valid = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
        recomputed = np.asarray(sequence_logprobs(model, model.params, tokens, valid, 0.8, 0))[:, p - 1:]
        diffs = np.concatenate([np.abs(recomputed[i, :n] - out.logprobs[i, :n]) for i, n in enumerate(out.lengths)])
        assert diffs.mean() <= 1e-5 and diffs.max() <= 1e-4, (ragged, diffs.mean(), diffs.max())


def test_hub_ids_resolve_through_the_local_cache_offline(tmp_path, monkeypatch):
    from grpo_stream.common.model.hf_checkpoint import resolve_model_dir

    snapshot = tmp_path / "hub" / "models--acme--tiny-qwen" / "snapshots" / "0123abcd"
    make_hf_model(snapshot, "qwen3-untied", 6)
    (tmp_path / "hub" / "models--acme--tiny-qwen" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-qwen" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import importlib

    import huggingface_hub.constants

    importlib.reload(huggingface_hub.constants)  # the cache location and offline flag are read at import
    try:
        assert resolve_model_dir("acme/tiny-qwen").resolve() == snapshot.resolve()
        with pytest.raises(CheckpointError, match="model.path=acme/missing: not a local directory"):
            resolve_model_dir("acme/missing")
        # the shipped real-model configs name a relative directory that reads as an id until the fixture makes it
        with pytest.raises(CheckpointError, match="`grpo-stream fixture smollm2`"):
            resolve_model_dir("models/smollm2-not-built")
        # `plan` reads the same cached id's config as the processes would (it knew known checkpoints by name only)
        from grpo_stream.plan.programs import checkpoint_architecture

        assert checkpoint_architecture("acme/tiny-qwen", "model.path") == read_architecture(snapshot)
        with pytest.raises(ValueError, match="model.path=acme/missing: no config.json there"):
            checkpoint_architecture("acme/missing", "model.path")
    finally:
        monkeypatch.undo()
        importlib.reload(huggingface_hub.constants)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_model_dir(str(tmp_path / "nowhere"))


MESH_SCRIPT = """
import sys
import numpy as np, jax, jax.numpy as jnp
from grpo_stream.common.model.policy import load_hf_model, positions_from_mask, causal_mask
mesh = jax.make_mesh((2, 2), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
sharded, plain = load_hf_model(sys.argv[1], "float32", mesh=mesh), load_hf_model(sys.argv[1], "float32")
q = [leaf for name, leaf in zip(sharded.names(), jax.tree_util.tree_leaves(sharded.params)) if name.endswith("q_proj.w")][0]
assert len(q.sharding.device_set) == 4 and q.addressable_shards[0].data.size == q.size // 4, q.sharding
tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 16)))
valid = jnp.ones(tokens.shape, bool)
# jitted, as the trainer runs it: one program with its collectives. Run op by op, dozens of small sharded programs
# are in flight at once, and on a 2-core machine XLA's CPU pool once ran half of one all-reduce's participants while
# the other half waited behind another program (a rendezvous that never completed, in CI)
a, _ = jax.block_until_ready(jax.jit(sharded.apply)(sharded.params, tokens, positions_from_mask(valid), None,
                                                     causal_mask(valid)))
b, _ = jax.jit(plain.apply)(plain.params, tokens, positions_from_mask(valid), None, causal_mask(valid))
np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
# tp=4 over 2 KV heads: an axis that does not divide a dimension is replicated there (as the trainer places), not an
# error; nothing lands whole on one device
wide = load_hf_model(sys.argv[1], "float32", mesh=jax.make_mesh((1, 4), ("fsdp", "tp"),
                                                                  axis_types=(jax.sharding.AxisType.Auto,) * 2))
assert all(len(leaf.sharding.device_set) == 4 for leaf in jax.tree_util.tree_leaves(wide.params))
print("ok")
"""


def test_loads_straight_onto_a_device_mesh(tmp_path):
    """4 fake CPU devices, fsdp=2 x tp=2: parameters are split across devices and logits are unchanged."""
    import os
    import subprocess
    import sys

    make_hf_model(tmp_path, "llama3.1-untied", 7)
    # a participant the loaded machine starves of CPU for a while is waited for (XLA's default gives up after 40 s)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4 "
           "--xla_cpu_collective_call_terminate_timeout_seconds=240"}
    root = pathlib.Path(__file__).resolve().parents[4]
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT, str(tmp_path)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_export_converts_one_tensor_at_a_time(tmp_path):
    """The export held two more copies of the model in host memory (its layout, then its dtype): about 420 GB on the
    trainer's first process for a 70B model. Now one tensor at a time beside the weights it was given."""
    import tracemalloc

    from tests.vllm_support import tiny_qwen2_dir

    model = load_hf_model(str(tiny_qwen2_dir(tmp_path / "model")), "float32")
    named = model.to_named_numpy()
    size = sum(a.nbytes for a in named.values())
    tracemalloc.start()
    try:
        export_hf(tmp_path / "out", model.arch, named, dtype="bfloat16")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 0.5 * size, (peak, size)  # measured 0.17 (the largest tensor); 1.9 before
    again = load_hf_model(str(tmp_path / "out"), "float32")
    for name, value in named.items():
        np.testing.assert_allclose(again.to_named_numpy()[name], value, rtol=1e-2, atol=1e-2)  # bf16 rounding


def test_sequences_longer_than_the_models_positions_are_refused(tmp_path):
    """A config.json's max_position_embeddings bounds the positions its RoPE was trained on (vLLM refuses a longer
    max_model_len); prompt + completion past it sampled from positions the model never saw, without a word."""
    from grpo_stream.common.engine.continuous import ContinuousEngine

    cls_name, extra = FAMILIES["qwen2.5-tied"]
    config = getattr(transformers, cls_name)(**{**SHAPE, **extra, "max_position_embeddings": 64})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = load_hf_model(str(tmp_path), "float32")
    ContinuousEngine(model, pad_id=0, eos_id=1, max_prompt_tokens=32, max_new_tokens=32, temperature=1.0)  # 64 fits
    with pytest.raises(ValueError, match=r"max_new_tokens = 80 exceeds the model's max_position_embeddings=64"):
        ContinuousEngine(model, pad_id=0, eos_id=1, max_prompt_tokens=48, max_new_tokens=32, temperature=1.0)
