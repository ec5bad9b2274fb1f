"""Benchmark (issue 45): multi-turn episodes with a slow tool. Useful tokens/s with 100 ms per tool call against
the same episodes with an instant tool, on the continuous JAX engine's `serve()` of a rollout stream
(common/episodes/tool_turns.py; the sampler's whole stream with a slow tool: `bench rollouts`).

    grpo-stream bench multiturn [--quick] [--json F]
    python -m grpo_stream.bench.multiturn [--quick] [--out F] [--set KEY=VALUE ...]   # KEY: a FULL/QUICK entry

Workload, the CPU demo's rows in flight (sampler.rows_in_flight 64: 8 prompts x generation.num_generations 8 = 64
episodes, all started at once; quick: 4 x 4): the CPU demo's addition prompts and tokenizer (configs/tiny_arith.yaml), each prompt's G
episodes together, on the sampler benchmark's Qwen3-shaped decoder (8 layers, width 512, MLP 1408, 8/2 heads of 64,
float32, random init) with the demo tokenizer's 160-token vocabulary (the sampler benchmark's 8192 would leave no
text to decode): 22.7M parameters. Each episode's number of model turns, 3..5, is drawn from a seeded RNG; the
simulated tool answers every model turn with a short result (` = 21`, a few tokens) and ends the episode after its
count (its answer to the last turn is a call too, unless the episode reached environment.max_turns = 5). Model turns
are at most 16 tokens (environment.turn_max_new_tokens); the engine stops at EOS as it does in a run (with random
weights most turns run to 16, some stop earlier) and a turn cut at its budget is answered like any other. The engine
has the run's defaults (generation.decode_slots 256, decode_chunk_steps 16) and the environment's steps run on a
pool of environment.workers (16) threads.

Both arms run the same episodes with the same keys, so they sample the same tokens (checked: the digest of every
episode's tokens); only the tool's latency (`EpisodeSettings.tool_latency_s`, slept on the pool's thread) differs.
Untimed rounds of both arms come first (compiling), until one compiles nothing or `warmup_rounds` have run: when turns
re-enter depends on thread timing, and each new (group size, window, prefill rows, prompt width) is a new program.
Then `repeats` rounds alternate one zero-latency and one 100 ms run (a drift of the machine's speed reaches both).
Useful tokens = the model's tokens of the episodes (not the observations); `ratio_latency_over_zero` = median
tokens/s with latency / median without (issue 45: >= 0.8, the latency hidden by other episodes' decoding).

Per run, beside wall time: turns; environment seconds (summed over the pool's threads, the sleeps included); the
seconds `serve` waited with no episode to decode (`engine_idle_seconds`: the latency not hidden, a figure the
machine's load moves much less than the ratio; `latency_not_hidden_share`: its median share of a latency run); the
cores this process kept busy (under 2 on a shared machine: others took the rest); the engine's counters over the run
(prefill_rows: every turn enters as a request and, with environment.kv_cache=reprefill, the default, its whole
conversation is prefilled again, `turn_prompt_tokens` in all; `--set hold_kv=1` measures kv_cache=hold instead,
`held_given_up` counting the held caches given up for waiting rows); and programs compiled during the run
(`new_programs`, 0 once warm; `programs_compiled_while_timed` sums them over the timed runs).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import pathlib
import statistics
import sys
import time
import types

import jax
import numpy as np

from grpo_stream.bench.sampler import SHAPE_KEYS
from grpo_stream.bench.sampler_workloads import Busy
from grpo_stream.common.config.environment import EnvironmentSection
from grpo_stream.common.config.learning import GenerationSection
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.environments.base import Observation, Turn
from grpo_stream.common.environments.render import PlainRenderer
from grpo_stream.common.episodes.finite import run_episodes
from grpo_stream.common.episodes.tool_turns import EpisodeSettings, ToolTurns
from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.model.policy import TUNIX_ROPE_THETA, build_from_architecture
from grpo_stream.common.tasks.arith import build_task
from grpo_stream.common.tasks.task_tokenizer import build_tokenizer
from grpo_stream.common.runtime.files import to_json, write_atomic

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_arith.yaml"
_GEN, _ENV = GenerationSection(), EnvironmentSection()
FULL = {"num_layers": 8, "embed_dim": 512, "hidden_dim": 1408, "num_heads": 8, "num_kv_heads": 2, "head_dim": 64,
        "prompts": 8, "generations": _GEN.num_generations, "turns_low": 3, "turns_high": 5, "turn_tokens": 16,
        "episode_tokens": 128, "tool_latency_s": 0.1, "repeats": 3, "slots": _GEN.decode_slots,
        "chunk_steps": _GEN.decode_chunk_steps, "workers": _ENV.workers, "seed": 0,
        "warmup_rounds": 3,  # untimed rounds of both arms at most, before the timed ones
        "hold_kv": 0}  # 1: environment.kv_cache=hold (a waiting episode keeps its slot's cache)
QUICK = {**FULL, "num_layers": 2, "embed_dim": 128, "hidden_dim": 256, "num_heads": 4, "head_dim": 32, "prompts": 4,
         "generations": 4, "repeats": 1, "warmup_rounds": 1}


class ToolEpisode:
    """A simulated tool: answers each model turn with a short result and ends the episode after `turns` turns."""

    def __init__(self, turns: int):
        self.turns, self.answered = turns, 0

    def step(self, turn_text: str) -> Turn:
        self.answered += 1
        if self.answered >= self.turns:
            return Turn(None)
        return Turn(Observation(f"= {self.answered * 21 % 100}"))


class Watched:
    """The engine seen through its request source (common/engine/base.py RequestSource): seconds `serve` waited
    with nothing to decode (every live episode at its tool: the latency not hidden) and the prompt tokens of the
    turns it took (each turn's prompt is the conversation so far: with kv_cache=reprefill all are prefilled)."""

    def __init__(self, engine):
        self.engine, self.idle_seconds, self.prompt_tokens = engine, 0.0, 0
        self.request_keys = engine.request_keys

    def serve(self, params, source, refresh=None, version=0):
        watched = self

        class Source:
            def take(self):
                taken = source.take()
                watched.prompt_tokens += sum(len(r.ids) for r in taken)
                return taken

            def finish(self, *args):
                source.finish(*args)

            def open(self):
                return source.open()

            def accepting(self):
                return source.accepting()

            def released(self):  # environment.kv_cache=hold: the held caches it will not resume
                return source.released()

            def cancelled(self):
                return source.cancelled()

            def wait(self, timeout):
                started = time.perf_counter()
                source.wait(timeout)
                watched.idle_seconds += time.perf_counter() - started
        return self.engine.serve(params, Source(), refresh, version)


def build_model(p: dict, vocab_size: int, max_positions: int):
    arch = Architecture(family="qwen3", norm_eps=1e-6, rope_theta=TUNIX_ROPE_THETA, tied_embeddings=False,
                        max_position_embeddings=max_positions, vocab_size=vocab_size,
                        **{k: p[k] for k in SHAPE_KEYS if k != "vocab_size"})
    return build_from_architecture(arch, seed=0)


class ScriptedTools:
    """The environment of the workload: episode i (problem.index) makes turns[i] model turns."""

    def __init__(self, turns: list[int]):
        self.turns = turns

    def start(self, problem):
        return ToolEpisode(self.turns[problem.index])


def run_arm(engine, params, prompts, turns, p: dict, latency: float, tokenizer) -> dict:
    """One run of the episodes with `latency` seconds per tool call: wall time, useful tokens/s, engine counters."""
    settings = EpisodeSettings(max_turns=p["turns_high"], turn_max_new_tokens=p["turn_tokens"],
                               episode_tokens=p["episode_tokens"], tool_latency_s=latency,
                               hold_kv=bool(p["hold_kv"]))
    before, programs = collections.Counter(engine.stats), len(engine.programs)
    watched = Watched(engine)
    kind = ToolTurns(ScriptedTools(turns), PlainRenderer(tokenizer), settings, tokenizer, p["workers"])
    problems = [types.SimpleNamespace(index=i, prompt_id=str(i), answer="") for i in range(len(prompts))]
    try:
        with Busy() as busy:
            results = run_episodes(watched, params, problems, prompts, kind, jax.random.key(p["seed"]))
    finally:
        kind.close()
    figures = {"turns": sum(r.turns for r in results), "environment_seconds": kind.environment_seconds}
    seconds = busy.seconds
    stats = {k: engine.stats[k] - before[k] for k in ("prefills", "prefill_rows", "decode_steps", "slot_steps",
                                                       "live_slot_steps")}
    digest = hashlib.sha256()
    for r in results:
        digest.update(np.asarray(r.tokens, np.int32).tobytes() + b"|")
    model_tokens = sum(sum(r.model_mask) for r in results)
    return {"seconds": round(seconds, 3), "model_tokens": model_tokens,
            "tokens_per_second": round(model_tokens / seconds, 1),
            "observation_tokens": sum(len(r.tokens) - sum(r.model_mask) for r in results),
            "turns": figures["turns"], "turns_per_episode": [r.turns for r in results],
            "turns_cut_at_budget": sum(not c for r in results for c in r.turn_closed),
            "tool_calls": sum(len(r.turn_rewards) for r in results),
            "environment_seconds": round(figures["environment_seconds"], 3),
            "engine_idle_seconds": round(watched.idle_seconds, 3), "cores_busy": round(busy.cores, 2),
            "turn_prompt_tokens": watched.prompt_tokens,
            "held_given_up": engine.stats["held_given_up"] - before["held_given_up"],
            "errors": sum(r.error is not None for r in results), "tokens_sha256": digest.hexdigest(),
            "new_programs": len(engine.programs) - programs,
            **stats, "slot_use": round(stats["live_slot_steps"] / max(stats["slot_steps"], 1), 3)}


def _say(message: str) -> None:
    print(f"bench multiturn: {message}", file=sys.stderr, flush=True)


def _line(name: str, run: dict) -> str:
    return (f"{name}: {run['seconds']:.2f} s, {run['tokens_per_second']:,.0f} model tokens/s ({run['model_tokens']} "
            f"tokens, {run['turns']} turns, {run['prefill_rows']} turns prefilled, environment "
            f"{run['environment_seconds']:.1f} s, engine idle {run['engine_idle_seconds']:.2f} s, "
            f"{run['cores_busy']:.2f} cores busy, {run['new_programs']} programs compiled)")


def time_arms(engine, params, prompts, turns, p: dict, tokenizer) -> tuple[dict, dict]:
    """Untimed rounds of both arms (until one compiles nothing), then `repeats` alternating timed rounds."""
    arms = {"zero": 0.0, "latency": p["tool_latency_s"]}
    warmup, runs = {}, {arm: [] for arm in arms}
    for round_ in range(1, p["warmup_rounds"] + 1):  # timing shifts the shapes: rounds until nothing compiles
        for arm, latency in arms.items():
            warmup[arm] = run_arm(engine, params, prompts, turns, p, latency, tokenizer)
            _say(_line(f"{arm} warm-up {round_} (compiles)", warmup[arm]))
        if not any(w["new_programs"] for w in warmup.values()):
            break
    for i in range(p["repeats"]):
        for arm, latency in arms.items():
            runs[arm].append(run_arm(engine, params, prompts, turns, p, latency, tokenizer))
            _say(_line(f"{arm} run {i + 1}/{p['repeats']}", runs[arm][-1]))
    return warmup, runs


def run(quick: bool = False, overrides: dict | None = None) -> dict:
    p = {**(QUICK if quick else FULL), **(overrides or {})}
    cfg = load_config(CONFIG)
    task = build_task(cfg)
    tokenizer = build_tokenizer(cfg, task)
    max_prompt = cfg.generation.max_prompt_tokens
    model = build_model(p, tokenizer.vocab_size, max_prompt + p["episode_tokens"])
    problems = [task.train_problem(i) for i in range(p["prompts"])]
    prompts = [tokenizer.encode(pr.prompt) for pr in problems for _ in range(p["generations"])]
    turns = np.random.default_rng(p["seed"]).integers(p["turns_low"], p["turns_high"] + 1, len(prompts)).tolist()
    engine = ContinuousEngine(model, tokenizer.pad_id, tokenizer.eos_ids, max_prompt, p["episode_tokens"], 1.0,
                              slots=p["slots"], chunk_steps=p["chunk_steps"])
    warmup, runs = time_arms(engine, model.params, prompts, turns, p, tokenizer)
    median = {arm: statistics.median(r["tokens_per_second"] for r in rs) for arm, rs in runs.items()}
    first = runs["zero"][0]
    per_episode = first["turns_per_episode"]
    return {"benchmark": "multiturn", "quick": quick,
            "ratio_latency_over_zero": round(median["latency"] / median["zero"], 3),
            "tokens_per_second": {arm: round(v, 1) for arm, v in median.items()},
            # the share of a latency run's wall time the engine waited with nothing to decode
            "latency_not_hidden_share": round(statistics.median(r["engine_idle_seconds"] / r["seconds"]
                                                                for r in runs["latency"]), 4),
            "run_seconds": {arm: round(statistics.median(r["seconds"] for r in rs), 3) for arm, rs in runs.items()},
            **{key: {arm: round(statistics.median(r[key] for r in rs), 3) for arm, rs in runs.items()}
               for key in ("environment_seconds", "engine_idle_seconds", "cores_busy")},
            "episodes": len(prompts), "turns": first["turns"], "model_tokens": first["model_tokens"],
            "tool_calls": first["tool_calls"], "prefills": first["prefills"], "turns_prefilled": first["prefill_rows"],
            "turn_prompt_tokens": first["turn_prompt_tokens"],
            "programs_compiled_while_timed": sum(r["new_programs"] for rs in runs.values() for r in rs),
            "turns_per_episode": {"min": min(per_episode), "max": max(per_episode),
                                  "mean": round(float(np.mean(per_episode)), 2)},
            "identical_workloads": len({r["tokens_sha256"] for rs in runs.values() for r in rs}) == 1,
            "tool_latency_s": p["tool_latency_s"], "runs": runs, "warmup": warmup,
            "engine": {"slots": p["slots"], "chunk_steps": p["chunk_steps"], "programs_compiled": len(engine.programs)},
            "workload": {k: p[k] for k in ("prompts", "generations", "turns_low", "turns_high", "turn_tokens",
                                           "episode_tokens", "workers", "repeats", "warmup_rounds", "hold_kv", "seed")},
            "model": {"parameters": model.num_params(), "vocab_size": tokenizer.vocab_size,
                      **{k: p[k] for k in SHAPE_KEYS if k != "vocab_size"}}}


def _override(text: str) -> tuple[str, float | int]:
    key, _, value = text.partition("=")
    if key not in FULL:
        raise argparse.ArgumentTypeError(f"--set {text}: unknown key; choose from {sorted(FULL)}")
    number = float(value) if "." in value else int(value)
    if key == "repeats" and number < 1:  # the median of no runs, after all the warm-up rounds
        raise argparse.ArgumentTypeError(f"--set {text}: at least one timed run per arm; give repeats >= 1")
    return key, number


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 16 episodes, one run per arm")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench/multiturn.json"),
                        help="the JSON result (default runs/bench/multiturn.json)")
    parser.add_argument("--set", type=_override, action="append", default=[], metavar="KEY=VALUE",
                        help="change a workload figure (e.g. prompts=32, workers=64)")
    args = parser.parse_args(argv)
    result = run(args.quick, dict(args.set))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, to_json(result, indent=2) + "\n")  # whole, and strict JSON (files.py)
    _say(f"ratio_latency_over_zero {result['ratio_latency_over_zero']} (target >= 0.8); wrote {args.out}")


if __name__ == "__main__":
    main()
