"""Benchmark: decode tokens/s of the JAX engine against Hugging Face `generate`, and vLLM's next to them.

Both sides run the same model: our Qwen3-architecture policy (Qwen2 plus q/k
RMSNorm; vocab 4096, width 256, MLP 1024, 8 layers, 4 query / 2 KV heads of
64, about 10M parameters) with random weights, and `transformers`'
`Qwen3ForCausalLM` built from the same config and loaded with the very same
weights. Before timing, the benchmark checks that the two produce the same
logits on the same tokens (`logits_max_abs_diff`), so the comparison is
like for like.

Same work on both sides: a batch of 16 prompts of 64 tokens, 128 new tokens
each, sampled at temperature 1 from the full distribution (HF's default
top-k 50 switched off), no early stop (EOS disabled), and the per-token
logprobs a sampler must return (HF: `output_scores`, then
`compute_transition_scores`). The vLLM engine (sampler.engine: vllm) runs the
same model, exported as a Hugging Face directory, in the vLLM environment
($GRPO_STREAM_VLLM_PYTHON or .venv-vllm; bench/vllm_decode.py), with the same
batch, lengths, temperature and logprobs; without that environment its
column says why it is missing. HF also runs without logprobs; `ratio_vs_hf`
is taken against the faster of its two runs. Torch uses its default CPU
threads (reported); JAX compiles once, reported apart (`jax_compile_seconds`),
as a long-running sampler pays it once per shape. Medians of `repeats` runs.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.config.learning import ModelSection, TinyModelSection
from grpo_stream.common.engine import decode
from grpo_stream.common.engine.jax_engine import Engine
from grpo_stream.common.model.policy import TUNIX_ROPE_THETA, PolicyModel, build_model, causal_mask, positions_from_mask

FULL = {"vocab_size": 4096, "num_layers": 8, "embed_dim": 256, "hidden_dim": 1024, "num_heads": 4,
        "num_kv_heads": 2, "head_dim": 64, "batch": 16, "prompt_tokens": 64, "new_tokens": 128, "repeats": 5}
QUICK = {**FULL, "num_layers": 2, "batch": 4, "prompt_tokens": 16, "new_tokens": 16, "repeats": 1}
NO_EOS = -1  # an id no sampler can draw, so every sequence runs to the full length on both sides


def hf_state_dict(named: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """Our parameter names and layouts -> `Qwen3ForCausalLM` state-dict names and [out, in] layouts."""
    out = {"model.embed_tokens.weight": named["embedder.input_embedding"],
           "model.norm.weight": named["final_norm.w"], "lm_head.weight": named["lm_head.w"].T}
    for i in range(num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj"):  # [embed, heads, head_dim]
            w = named[f"{ours}attn.{proj}.w"]
            out[f"{hf}self_attn.{proj}.weight"] = w.reshape(w.shape[0], -1).T
        o = named[f"{ours}attn.o_proj.w"]  # [heads, head_dim, embed]
        out[f"{hf}self_attn.o_proj.weight"] = o.reshape(-1, o.shape[-1]).T
        for norm in ("q_norm", "k_norm"):
            out[f"{hf}self_attn.{norm}.weight"] = named[f"{ours}attn.{norm}.w"]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            out[f"{hf}mlp.{proj}.weight"] = named[f"{ours}mlp.{proj}.kernel"].T
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{hf}{norm}.weight"] = named[f"{ours}{norm}.w"]
    return out


def build_hf(model: PolicyModel, p: dict):
    """`Qwen3ForCausalLM` with our model's config and weights (float32, eval mode)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = model.config
    hf_cfg = Qwen3Config(vocab_size=p["vocab_size"], hidden_size=cfg.embed_dim, intermediate_size=cfg.hidden_dim,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
                         rope_theta=float(TUNIX_ROPE_THETA), tie_word_embeddings=False,
                         max_position_embeddings=p["prompt_tokens"] + p["new_tokens"], pad_token_id=None,
                         bos_token_id=None, eos_token_id=None)
    hf = Qwen3ForCausalLM(hf_cfg).eval()
    state = {k: torch.from_numpy(np.array(v)) for k, v in
             hf_state_dict(model.to_named_numpy(), cfg.num_layers).items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if [m for m in missing if "rotary" not in m] or unexpected:
        raise RuntimeError(f"weight mapping to Qwen3ForCausalLM is incomplete: missing {missing}, "
                           f"unexpected {unexpected}")
    return hf


def logits_max_abs_diff(model: PolicyModel, hf, tokens: np.ndarray) -> float:
    """Largest |ours - HF| over the logits of every position of `tokens` (no padding)."""
    import torch

    valid = jnp.ones(tokens.shape, jnp.bool_)
    ours, _ = model.apply(model.params, jnp.asarray(tokens), positions_from_mask(valid),
                          model.init_cache(*tokens.shape), causal_mask(valid))
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    return float(np.max(np.abs(np.asarray(ours) - theirs)))


def _hf_generate(hf, tokens: np.ndarray, new_tokens: int, seed: int, logprobs: bool) -> float:
    """Seconds for one sampled generation of `new_tokens` per row (plus logprobs when asked)."""
    import torch

    torch.manual_seed(seed)
    ids = torch.from_numpy(tokens.astype(np.int64))
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                          top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                          pad_token_id=0, return_dict_in_generate=True, output_scores=logprobs)
        if logprobs:
            lp = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
            if lp.shape != (tokens.shape[0], new_tokens):
                raise RuntimeError(f"HF returned logprobs of shape {tuple(lp.shape)}")
    seconds = time.perf_counter() - start
    if out.sequences.shape != (tokens.shape[0], tokens.shape[1] + new_tokens):
        raise RuntimeError(f"HF generated {tuple(out.sequences.shape)}, not the full length")
    return seconds


def matmul_floor_seconds(model: PolicyModel, batch: int, steps: int, repeats: int) -> float:
    """Seconds for only the weight matmuls of `steps` one-token decode steps (the same shapes as the engine's).

    The profile of what limits decoding: at batch 16 a 10M-parameter model
    spends its step in these products; the engine's time over this floor is
    everything else (attention, norms, sampling, cache updates).
    """
    w = decode.decode_weights(model, model.params)
    heads_dim = model.config.num_heads * model.config.head_dim
    hidden = model.config.hidden_dim

    @jax.jit
    def chain(x):
        def step(x, _):
            for layer in w.layers:
                x = x + (x @ layer.qkv)[:, :heads_dim] @ layer.out
                x = x + (x @ layer.gate_up)[:, :hidden] @ layer.down
            logits = x @ w.lm_head
            return x + 1e-6 * logits[:, :1], None
        return jax.lax.scan(step, x, None, length=steps)[0]

    x = jnp.ones((batch, model.config.embed_dim), jnp.float32)
    chain(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        chain(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def vllm_decode(model: PolicyModel, p: dict) -> dict:
    """vLLM's decode tokens/s on `model`, measured in the vLLM environment; {"missing": why} without one."""
    from grpo_stream.common.model.hf_checkpoint import export_hf

    root = pathlib.Path(__file__).resolve().parent.parent
    python = pathlib.Path(os.environ.get("GRPO_STREAM_VLLM_PYTHON", root / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        return {"missing": f"no vLLM environment at {python} (requirements/install-vllm-env.sh)"}
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        export_hf(tmp, model.arch, model.to_named_numpy())
        proc = subprocess.run([str(python), "-m", "grpo_stream.bench.vllm_decode", tmp, str(p["batch"]), str(p["prompt_tokens"]),
                               str(p["new_tokens"]), str(p["repeats"])], cwd=root, capture_output=True, text=True,
                              timeout=900)
    if proc.returncode:
        raise RuntimeError(f"the vLLM measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> dict:
    import torch
    import transformers

    p = QUICK if quick else FULL
    section = ModelSection(tiny=TinyModelSection(**{k: p[k] for k in (
        "vocab_size", "num_layers", "embed_dim", "hidden_dim", "num_heads", "num_kv_heads", "head_dim")}))
    model = build_model(section, p["vocab_size"], seed=0)
    hf = build_hf(model, p)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, p["vocab_size"], (p["batch"], p["prompt_tokens"])).astype(np.int32)
    diff = logits_max_abs_diff(model, hf, prompts)
    if diff > 1e-3:
        raise RuntimeError(f"the two models disagree (logits differ by {diff:.2e}); the comparison would be unfair")

    engine = Engine(model, pad_id=0, eos_id=NO_EOS, max_prompt_tokens=p["prompt_tokens"],
                    max_new_tokens=p["new_tokens"], temperature=1.0)
    prompt_lists = [list(map(int, row)) for row in prompts]
    start = time.perf_counter()
    first = engine.generate(model.params, prompt_lists, jax.random.key(0))
    compile_seconds = time.perf_counter() - start
    if first.tokens.shape != (p["batch"], p["new_tokens"]) or not np.all(first.lengths == p["new_tokens"]):
        raise RuntimeError("the JAX engine stopped early; EOS was meant to be disabled")

    _hf_generate(hf, prompts[:, :8], 4, seed=0, logprobs=True)  # warm-up: allocator, kernels
    ours, hf_lp, hf_plain = [], [], []
    for r in range(p["repeats"]):
        start = time.perf_counter()
        engine.generate(model.params, prompt_lists, jax.random.key(r + 1))
        ours.append(time.perf_counter() - start)
        hf_lp.append(_hf_generate(hf, prompts, p["new_tokens"], r, logprobs=True))
        hf_plain.append(_hf_generate(hf, prompts, p["new_tokens"], r, logprobs=False))
    tokens = p["batch"] * p["new_tokens"]
    floor = matmul_floor_seconds(model, p["batch"], p["new_tokens"], p["repeats"])
    rate = {"ours": tokens / statistics.median(ours), "hf": tokens / statistics.median(hf_lp),
            "hf_without_logprobs": tokens / statistics.median(hf_plain)}
    baseline = max(rate["hf"], rate["hf_without_logprobs"])
    vllm = vllm_decode(model, p)
    if "tokens_per_second" in vllm:
        rate["vllm"] = vllm.pop("tokens_per_second")
    return {
        "benchmark": "sampler", "quick": quick, "params": model.num_params(), "batch": p["batch"],
        "prompt_tokens": p["prompt_tokens"], "new_tokens": p["new_tokens"], "repeats": p["repeats"],
        "model": {k: p[k] for k in ("vocab_size", "num_layers", "embed_dim", "hidden_dim", "num_heads",
                                    "num_kv_heads", "head_dim")},
        "tokens_per_second": {k: round(v, 1) for k, v in rate.items()},
        "ratio_vs_hf": round(rate["ours"] / baseline, 3),
        "ratio_vs_hf_with_logprobs": round(rate["ours"] / rate["hf"], 3),
        # > 1: the JAX engine decodes faster than vLLM on this model and machine
        "ratio_vs_vllm": round(rate["ours"] / rate["vllm"], 3) if "vllm" in rate else None,
        "vllm": vllm,
        # decode time spent in weight matmuls alone: near 1 means the engine is at the machine's matmul speed
        "matmul_floor_tokens_per_second": round(tokens / floor, 1),
        "matmul_share_of_decode": round(floor / statistics.median(ours), 3),
        "logits_max_abs_diff": diff, "jax_compile_seconds": round(compile_seconds - statistics.median(ours), 2),
        "torch_threads": torch.get_num_threads(),
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }
