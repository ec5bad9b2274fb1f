"""Benchmark: useful tokens/s of the JAX sampling engine on GRPO-shaped request sets, against the static JAX
engine it replaced, vLLM (its CPU build, in the vLLM environment) and Hugging Face `generate`.

Every engine runs the same model with the same weights: a Qwen3-architecture decoder (vocab 8192, width 512,
MLP 1408, 8 layers, 8 query / 2 KV heads of 64: 31M parameters, float32, random init), exported as a Hugging
Face directory for vLLM and `transformers` (which is checked to give the same logits first). Same request set
for every engine: 64 prompts of 32-128 random tokens, 8 completions each (a GRPO group's rows), sampled at
temperature 1 from the full distribution, EOS disabled so every row generates exactly its budget:

- `longtail`: budgets with a GSM8K-like long tail (log-normal, median 128 = max_new_tokens / 4, clipped at
  max_new_tokens = 512, so some rows run to the limit);
- `fixed`: every row 512 tokens.

Each engine compiles or warms up once untimed, then runs the set `repeats` times; reported are the median
useful tokens/s and the cores it kept busy. The static engine and HF `generate` batch statically, so both cases are
the same work for them (every row runs to the longest budget, 512 in both); each is timed on one case and its rate
on the other is that case's useful tokens over the same seconds. `ratio_vs_X` = ours / X, the targets of issue 21.

`GRPO_STREAM_BENCH_ENGINES` (comma-separated, of ours, static, vllm, hf; default all) times only those engines:
HF `generate` takes about an hour of a full run on 2 cores, and the other engines' ratios do not need it.
"""

from __future__ import annotations

import os
import tempfile

import jax
import numpy as np

from grpo_stream.bench.sampler_workloads import (NO_EOS, longtail_budgets, make_prompts, time_hf, time_jax_engine,
                                                 time_vllm)
from grpo_stream.bench.static_engine import StaticEngine
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.policy import TUNIX_ROPE_THETA, build_from_architecture

FULL = {"vocab_size": 8192, "num_layers": 8, "embed_dim": 512, "hidden_dim": 1408, "num_heads": 8,
        "num_kv_heads": 2, "head_dim": 64, "prompts": 64, "generations": 8, "prompt_low": 32, "prompt_high": 128,
        "max_new_tokens": 512, "repeats": 3, "slots": 256, "chunk_steps": 16}
QUICK = {**FULL, "num_layers": 2, "embed_dim": 128, "hidden_dim": 256, "num_heads": 4, "head_dim": 32,
         "prompts": 4, "generations": 4, "prompt_low": 8, "prompt_high": 24, "max_new_tokens": 32, "repeats": 1,
         "slots": 8, "chunk_steps": 8}
ENGINES = ("ours", "static", "vllm", "hf")
SHAPE_KEYS = ("vocab_size", "num_layers", "embed_dim", "hidden_dim", "num_heads", "num_kv_heads", "head_dim")


def build_model(p: dict):
    arch = Architecture(family="qwen3", norm_eps=1e-6, rope_theta=TUNIX_ROPE_THETA, tied_embeddings=False,
                        max_position_embeddings=p["prompt_high"] + p["max_new_tokens"],
                        **{k: p[k] for k in SHAPE_KEYS})
    return build_from_architecture(arch, seed=0)


def load_hf(model, dtype: str = "float32", device: str = "cpu"):
    """`transformers`' model of the same architecture with the same weights (in `dtype`, on `device`), and the
    largest difference of its logits from ours over their largest magnitude (relative: a bfloat16 model's logits
    round differently on each side; a wrong architecture differs by O(1))."""
    import torch
    import transformers

    from grpo_stream.common.model.hf_checkpoint import export_hf
    from grpo_stream.common.model.policy import causal_mask, positions_from_mask

    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        export_hf(tmp, model.arch, model.to_named_numpy(), dtype=dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=getattr(torch, dtype)).to(device).eval()
    tokens = np.random.default_rng(0).integers(2, model.arch.vocab_size, (2, 24)).astype(np.int32)
    valid = np.ones(tokens.shape, np.bool_)
    ours, _ = model.apply(model.params, tokens, positions_from_mask(valid), None, causal_mask(valid))
    ours = np.asarray(ours, np.float32)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens.astype(np.int64)).to(device)).logits.float().cpu().numpy()
    return hf, float(np.max(np.abs(ours - theirs)) / max(float(np.max(np.abs(theirs))), 1e-6))


def run_case(name: str, model, p: dict, prompts: list[list[int]], budgets: list[int], timed: tuple[str, ...],
             hf: dict | None,
             vllm: dict) -> dict:
    args = (model, 0, NO_EOS, p["prompt_high"], p["max_new_tokens"], 1.0)
    engine = ContinuousEngine(*args, slots=p["slots"], chunk_steps=p["chunk_steps"])
    ours = time_jax_engine(engine, model.params, prompts, budgets, p["repeats"])
    ours["programs_compiled"] = len(engine.programs)
    runs = p["repeats"] + 1
    ours["decode_steps_per_run"] = engine.stats["decode_steps"] // runs
    ours["slot_use"] = round(engine.stats["live_slot_steps"] / max(engine.stats["slot_steps"], 1), 3)
    ours["prefills_per_run"] = engine.stats["prefills"] // runs
    # attention work: slot x window positions over the steps, and the long-window group's traffic
    ours["cache_positions_read_per_run"] = engine.stats["cache_positions_read"] // runs
    # what attention read: the slots' own positions with the ragged CPU kernel, else the windows
    ours["attention_positions_read_per_run"] = engine.stats["attention_positions_read"] // runs
    ours["rows_moved_per_run"] = engine.stats["moved_rows"] // runs
    ours["group_merges_per_run"] = engine.stats["merges"] // runs
    engines = {"ours": ours}
    if name == "longtail" and "static" in timed:  # the same cost with every row at the limit: timed on longtail
        engines["static"] = time_jax_engine(StaticEngine(*args), model.params, prompts, budgets, p["repeats"])
    engines.update({k: v for k, v in (("hf", hf), ("vllm", vllm)) if v is not None})
    rate = {k: v["tokens_per_second"] for k, v in engines.items() if "tokens_per_second" in v}
    result = {"rows": len(prompts), "useful_tokens": int(sum(budgets)),
              "budget_median": int(np.median(budgets)), "budget_mean": round(float(np.mean(budgets)), 1),
              "budget_max": int(max(budgets)), "rows_at_limit": int(sum(b == p["max_new_tokens"] for b in budgets)),
              "engines": engines}
    for other in ("static", "vllm", "hf"):
        if other in rate:
            result[f"ratio_vs_{other}"] = round(rate["ours"] / rate[other], 3)
    return result


def selected_engines() -> tuple[str, ...]:
    """The engines to time (GRPO_STREAM_BENCH_ENGINES, default all); "ours" always."""
    raw = os.environ.get("GRPO_STREAM_BENCH_ENGINES", "")
    chosen = {e.strip() for e in raw.split(",") if e.strip()} or set(ENGINES)
    unknown = chosen - set(ENGINES)
    if unknown:
        raise ValueError(f"GRPO_STREAM_BENCH_ENGINES: unknown {sorted(unknown)}; choose from {list(ENGINES)}")
    return tuple(e for e in ENGINES if e in chosen | {"ours"})


def run(quick: bool = False) -> dict:
    import torch
    import transformers

    p = QUICK if quick else FULL
    engines = selected_engines()
    model = build_model(p)
    hf, diff = load_hf(model)
    if diff > 1e-3:
        raise RuntimeError(f"ours and transformers disagree (logits differ by {diff:.2e} of their largest); the "
                           "comparison is unfair")
    prompts = make_prompts(p["prompts"], p["generations"], p["prompt_low"], p["prompt_high"], p["vocab_size"], 0)
    longtail = longtail_budgets(len(prompts), p["max_new_tokens"], p["max_new_tokens"] / 4, 0.9, seed=1)
    fixed = [p["max_new_tokens"]] * len(prompts)
    skipped = {"longtail": None, "fixed": None}
    hf_runs = (time_hf(hf, prompts, {"longtail": longtail, "fixed": fixed}, p["repeats"]) if "hf" in engines
               else skipped)
    vllm = (time_vllm(model, {"longtail": (prompts, longtail), "fixed": (prompts, fixed)}, p["repeats"], p["slots"])
            if "vllm" in engines else skipped)
    result = {"benchmark": "sampler", "quick": quick, "params": model.num_params(),
              "model": {k: p[k] for k in SHAPE_KEYS}, "logits_max_rel_diff": diff,
              **{k: p[k] for k in ("prompts", "generations", "max_new_tokens", "repeats", "slots", "chunk_steps")},
              "engines_timed": list(engines),
              "longtail": run_case("longtail", model, p, prompts, longtail, engines, hf_runs["longtail"],
                                   vllm["longtail"]),
              "fixed": run_case("fixed", model, p, prompts, fixed, engines, hf_runs["fixed"], vllm["fixed"]),
              "versions": {"jax": jax.__version__, "torch": torch.__version__,
                           "transformers": transformers.__version__}}
    if "missing" in (vllm["longtail"] or {}):  # no vLLM environment: the ratio is missing (None, not 0.0, which
        for case in ("longtail", "fixed"):  # would read as "ours made nothing"); runner's targets count it unmet
            result[case]["ratio_vs_vllm"] = None
    return result

