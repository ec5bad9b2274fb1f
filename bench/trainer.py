"""Benchmark: useful (non-pad) tokens per second of the trainer's update step, packed (trainer.packing) against the
padded layout it replaced (one sequence a row: trainer.packing=false, through the same update), on a GSM8K-shaped
long-tailed batch.

Model: a Qwen3-architecture decoder (vocab 8192, width 512, MLP 1408, 8 layers, 8 query / 2 KV heads of 64: 31M
parameters, float32, random init), the sampler benchmark's. Batch: 4 groups of 8 sequences (32), laid out as the
trainer lays them out at max_prompt_tokens 256 + max_new_tokens 1024:
- prompts of 60..250 tokens, uniform (GSM8K questions under a chat template), one per group;
- completions log-normal around a median of 256 = max_new_tokens / 4 with sigma 0.9, clipped to 4..1024 (the
  longest always at the limit; bench/sampler_workloads.longtail_budgets, the sampler benchmark's law).
Both layouts run passes of the same size: 2 sequences (padded, trainer.micro_batch_size=2) or 2 packed rows of
1,280 tokens (trainer.tokens_per_micro_batch=2560), so both hold the same activations at once. Each update runs
once untimed (compiles), then `repeats` rounds of one padded and one packed update alternate (a drift in the
machine's speed reaches both); reported are the medians. `ratio_vs_padded` = packed useful tokens/s
over padded, without a reference model (algo.beta=0); `with_reference` repeats it with algo.beta=0.04, which adds
the reference model's forward pass over the same layout.
"""

from __future__ import annotations

import sys
import time

import jax
import numpy as np

from grpo_stream.bench.sampler import SHAPE_KEYS
from grpo_stream.bench.sampler_workloads import longtail_budgets
from grpo_stream.common.config.learning import AlgoSection
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.policy import TUNIX_ROPE_THETA, build_from_architecture
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.learning.packing import PackingLayout, one_sequence_per_row, segments_per_row
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater

FULL = {"vocab_size": 8192, "num_layers": 8, "embed_dim": 512, "hidden_dim": 1408, "num_heads": 8,
        "num_kv_heads": 2, "head_dim": 64, "groups": 4, "generations": 8, "prompt_low": 60, "prompt_high": 250,
        "max_prompt_tokens": 256, "max_new_tokens": 1024, "sigma": 0.9, "rows_per_pass": 2, "repeats": 3}
QUICK = {**FULL, "vocab_size": 512, "num_layers": 2, "embed_dim": 64, "hidden_dim": 128, "num_heads": 4,
         "head_dim": 16, "groups": 2, "generations": 4, "prompt_low": 6, "prompt_high": 24, "max_prompt_tokens": 24,
         "max_new_tokens": 64, "repeats": 1}


def build_model(p: dict):
    arch = Architecture(family="qwen3", norm_eps=1e-6, rope_theta=TUNIX_ROPE_THETA, tied_embeddings=False,
                        max_position_embeddings=p["max_prompt_tokens"] + p["max_new_tokens"],
                        **{k: p[k] for k in SHAPE_KEYS})
    return build_from_architecture(arch, seed=0)


def long_tailed_batch(p: dict, seed: int = 0) -> TrainBatch:
    """The module docstring's batch in the trainer's padded layout, with random tokens, behaviour logprobs and
    group-normalised advantages."""
    rng = np.random.default_rng(seed)
    n, big_p, c = p["groups"] * p["generations"], p["max_prompt_tokens"], p["max_new_tokens"]
    prompts = np.repeat(rng.integers(p["prompt_low"], p["prompt_high"] + 1, p["groups"]), p["generations"])
    completions = np.asarray(longtail_budgets(n, c, c / 4, p["sigma"], seed + 1))
    tokens, valid = np.zeros((n, big_p + c), np.int32), np.zeros((n, big_p + c), np.bool_)
    mask, behaviour = np.zeros((n, big_p + c - 1), np.float32), np.zeros((n, big_p + c - 1), np.float32)
    for i, (lp, lc) in enumerate(zip(prompts, completions)):
        tokens[i, big_p - lp:big_p + lc] = rng.integers(1, p["vocab_size"], lp + lc)
        valid[i, big_p - lp:big_p + lc] = True
        mask[i, big_p - 1:big_p - 1 + lc] = 1.0
        behaviour[i, big_p - 1:big_p - 1 + lc] = -rng.uniform(0.5, 8.0, lc)
    rewards = rng.integers(0, 2, (p["groups"], p["generations"])).astype(np.float32)
    advantages = ((rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-4)).reshape(-1)
    return TrainBatch(tokens=tokens, valid=valid, loss_mask=mask, behaviour_logprobs=behaviour,
                      advantages=advantages.astype(np.float32), fresh=np.ones(n, np.float32))


def new_updater(model, algo: AlgoSection, p: dict, packed: bool) -> PolicyUpdater:
    rows = p["rows_per_pass"]
    length = p["max_prompt_tokens"] + p["max_new_tokens"]
    sequences = p["groups"] * p["generations"]
    layout = (PackingLayout(p["max_prompt_tokens"], length, rows, segments_per_row(length), -(-sequences // rows))
              if packed else one_sequence_per_row(p["max_prompt_tokens"], length, rows, sequences))
    return PolicyUpdater(model, jax.tree.map(jax.numpy.copy, model.params), algo, 1e-5, 1.0, 1.0, 0, layout,
                         donate=True)


def timed_update(updater: PolicyUpdater, batch: TrainBatch) -> tuple[float, dict]:
    start = time.perf_counter()
    metrics = updater.update(batch)
    jax.block_until_ready(updater.params)
    return time.perf_counter() - start, metrics


def compare(model, batch: TrainBatch, algo: AlgoSection, p: dict) -> dict:
    """Both layouts' updates over `batch`: each once untimed (compiles), then `repeats` rounds of one padded and
    one packed update, alternating so a drift of the machine's speed reaches both alike; medians."""
    updaters = {"padded": new_updater(model, algo, p, False), "packed": new_updater(model, algo, p, True)}
    first, laid_out, seconds = {}, {}, {name: [] for name in updaters}
    for name, updater in updaters.items():
        first[name], metrics = timed_update(updater, batch)
        laid_out[name] = int(metrics["update_tokens_laid_out"])
        print(f"bench trainer: beta {algo.beta}, {name}: first update (compiles) {first[name]:.1f} s",
              file=sys.stderr, flush=True)
    for i in range(p["repeats"]):
        for name, updater in updaters.items():
            seconds[name].append(timed_update(updater, batch)[0])
            print(f"bench trainer: beta {algo.beta}, {name}: update {i + 1}/{p['repeats']} {seconds[name][-1]:.1f} s",
                  file=sys.stderr, flush=True)
    useful = int(np.asarray(batch.valid).sum())
    out = {name: {"seconds": [round(x, 3) for x in seconds[name]],
                  "median_seconds": round(float(np.median(seconds[name])), 3),
                  "first_update_seconds": round(first[name], 2), "useful_tokens": useful,
                  "laid_out_tokens": laid_out[name],
                  "useful_tokens_per_s": round(useful / float(np.median(seconds[name])), 1)} for name in updaters}
    out["ratio_vs_padded"] = round(out["packed"]["useful_tokens_per_s"] / out["padded"]["useful_tokens_per_s"], 3)
    return out


def run(quick: bool = False) -> dict:
    p = QUICK if quick else FULL
    model = build_model(p)
    batch = long_tailed_batch(p)
    lengths = np.asarray(batch.valid).sum(axis=1)
    completions = np.asarray(batch.loss_mask).sum(axis=1)
    plain = compare(model, batch, AlgoSection(), p)
    with_reference = compare(model, batch, AlgoSection(beta=0.04), p)
    return {"benchmark": "trainer", "quick": quick,
            "trainer": {"ratio_vs_padded": plain["ratio_vs_padded"],
                        "useful_tokens_per_s": plain["packed"]["useful_tokens_per_s"],
                        "padded_useful_tokens_per_s": plain["padded"]["useful_tokens_per_s"],
                        "without_reference": plain, "with_reference": with_reference},
            "batch": {"sequences": len(lengths), "row_tokens": p["max_prompt_tokens"] + p["max_new_tokens"],
                      "real_fraction": round(float(lengths.sum() / (len(lengths) * batch.tokens.shape[1])), 3),
                      "completion_median": int(np.median(completions)), "completion_max": int(completions.max()),
                      "at_limit": int((completions == p["max_new_tokens"]).sum())},
            "model": {"parameters": model.num_params(), **{k: p[k] for k in SHAPE_KEYS}},
            "passes": {"rows_per_pass": p["rows_per_pass"], "repeats": p["repeats"]}}
