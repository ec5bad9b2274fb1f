"""Benchmark (issue 55): a sampler's rollout stream against the same engine handed every sequence at once, and
against the batch loop the stream replaced, in one run; and the stream with multi-turn episodes and a slow tool.

    grpo-stream bench rollouts [--quick] [--json F]
    python -m grpo_stream.bench.rollouts [--quick] [--out F]

Single turn. The sampler benchmark's model (a Qwen3-shaped decoder: vocab 8192, width 512, MLP 1408, 8 layers, 8/2
heads of 64, 31M parameters, float32, random init) on a long-tailed request set: 64 prompts of 32-128 random tokens,
8 completions each (512 rows), budgets log-normal around 96 clipped at 512 (bench/sampler_workloads.py), EOS
disabled so every row makes its budget: useful tokens = the budgets' sum, the same in every arm. One engine
(generation.decode_slots 256, decode_chunk_steps 16) for all arms:
- `all_at_once`: `engine.generate` of all 512 rows (the engine's own best; its time is the engine's alone);
- `stream`: the sampler's rollout stream (common/episodes/stream.py) fed as a sampler's feeder feeds it: a group of
  8 rows starts whenever sampler.rows_in_flight (256: what fills the engine) leaves room; each group, as its last
  row ends, is scored on the group sink's thread with the run's real rewards (answer_correct + answer_format on the
  decoded text) and handed to a sink that does what the ingest does to it (the wire encoding and
  `validate_group`) and acknowledges it; the time runs to the last acknowledgement;
- `batch_loop`: the loop the stream replaced: 32 rows (4 groups, the presets' 8 x 4) generated at a time, each
  batch waiting for its longest row, then scored and sunk, batch after batch.
And the cost of `drain` (sampler.weight_updates) against `in_flight`: the stream again with a new weight version
every `version_every_s` (10 s: a few per run), installed at the engine's next scheduling point (`updates_in_flight`)
or once the groups in flight have ended, no group starting meanwhile (`updates_drain`); `drain_over_in_flight`.

Untimed rounds of every arm come first, until one compiles nothing (or `warmup_rounds` ran), then `repeats` rounds
alternate the arms (a drift of the machine's speed reaches all); medians, and the programs each timed run still
compiled (`new_programs`). `stream_over_all_at_once` (issue 55: >= 0.9) and `stream_over_batch_loop` (>= 2).

Multi-turn. A shape whose turn decodes faster than the tool: the multi-turn benchmark's quick decoder (2 layers,
width 128; the CPU demo's 160-token vocabulary and addition prompts), episodes of 3-5 model turns of at most 4
tokens within 48 (decode chunks of 4 steps; `turn_seconds`: a turn's steps at the measured step time, its prefill
included, below the tool's 100 ms), each answered by a simulated tool; 128 groups of 8 episodes streamed as a sampler streams them: at most rows_in_flight 256 (four times
the engine's 64 slots, the default for episodes, which leave their slot while a tool answers), a group starting
while fewer turns than slots want the engine. Arms: the tool answers at
once (`zero`) or after 100 ms (`latency`), the same episodes (same keys). `multiturn.ratio_latency_over_zero`
(>= 0.8) and `multiturn.engine_idle_share` (the share of the latency run the engine waited with nothing to decode,
<= 0.05).
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys
import threading
import time
import types

import jax
import numpy as np

from grpo_stream.bench import multiturn
from grpo_stream.bench.sampler import build_model
from grpo_stream.bench.sampler_workloads import NO_EOS, Busy, longtail_budgets, make_prompts
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.engine.continuous import ContinuousEngine
from grpo_stream.common.environments.render import PlainRenderer
from grpo_stream.common.episodes.groups import build_group
from grpo_stream.common.episodes.result import EpisodeResult, GroupWork
from grpo_stream.common.episodes.single_turn import SingleTurn
from grpo_stream.common.episodes.stream import RolloutStream
from grpo_stream.common.episodes.tool_turns import EpisodeSettings, ToolTurns
from grpo_stream.common.rollouts.wire import GroupLimits, model_mask_of, to_proto, validate_group
from grpo_stream.common.tasks.arith import build_task
from grpo_stream.common.tasks.task_tokenizer import build_tokenizer
from grpo_stream.common.tasks.reward_workers import RewardWorker
from grpo_stream.common.tasks.rewards import DEFAULT_WEIGHTS, RewardSet
from grpo_stream.sampler_service.engine_thread import EngineThread
from grpo_stream.sampler_service.group_sink import GroupSink
from grpo_stream.sampler_service.lifecycle import SamplerMetrics
from grpo_stream.sampler_service.weight_sync import Installed
from grpo_stream.sampler_service.weights_in_use import StagedWeights
from grpo_stream.common.runtime.files import to_json, write_atomic

FULL = {"vocab_size": 8192, "num_layers": 8, "embed_dim": 512, "hidden_dim": 1408, "num_heads": 8,
        "num_kv_heads": 2, "head_dim": 64, "prompts": 64, "generations": 8, "prompt_low": 32, "prompt_high": 128,
        "max_new_tokens": 512, "median": 96, "sigma": 0.9, "slots": 256, "chunk_steps": 16, "rows_in_flight": 256,
        "batch_rows": 32, "version_every_s": 10.0, "repeats": 3, "warmup_rounds": 3, "seed": 0,
        "mt_groups": 128, "mt_slots": 64, "mt_rows_in_flight": 256, "mt_warmup_rounds": 6, "mt_latency_s": 0.1,
        "mt_turn_tokens": 4, "mt_chunk_steps": 4, "mt_episode_tokens": 48, "mt_workers": 256}
QUICK = {**FULL, "num_layers": 2, "embed_dim": 128, "hidden_dim": 256, "num_heads": 4, "head_dim": 32, "prompts": 8,
         "generations": 4, "prompt_low": 8, "prompt_high": 24, "max_new_tokens": 48, "median": 12, "slots": 16,
         "rows_in_flight": 16, "batch_rows": 8, "version_every_s": 0.1, "repeats": 1, "mt_groups": 4, "mt_slots": 8,
         "mt_rows_in_flight": 16, "mt_warmup_rounds": 1,
         "mt_workers": 16}
DEMO = pathlib.Path(__file__).resolve().parent.parent / "configs" / "tiny_arith.yaml"


class Digits:
    """Decodes token ids as digits and spaces (id % 11), so the rewards parse numbers out of real text of each
    completion's length (the random model's vocabulary has no text of its own)."""

    def decode(self, ids) -> str:
        return "".join(" " if t % 11 == 10 else str(t % 11) for t in ids)


def model_tokens(completion) -> int:
    """The tokens of a wire completion the model sampled: its environment's observation tokens (model_token_mask 0,
    in multi-turn episodes) are prompt to the next turn, not work the sampler did, so "useful tokens" leaves them out,
    as bench multiturn does."""
    mask = model_mask_of(completion)
    return len(completion.token_ids_le) // 4 if mask is None else int(mask.sum())


class AckingSink:
    """What the ingest does with a group before it acknowledges it: the wire encoding and its validation."""

    def __init__(self, limits: GroupLimits):
        self.limits, self.acked, self.tokens, self.last = limits, 0, 0, 0.0

    def put(self, message, timeout_s: float = 0.0, epoch: str = "", evaluation_only: bool = False) -> bool:
        payload = message.SerializeToString()
        errors = validate_group(type(message).FromString(payload), self.limits)
        if errors:
            raise ValueError(f"the bench's group is invalid: {errors[:3]}")
        self.acked += 1
        self.tokens += sum(model_tokens(c) for c in message.completions)
        self.last = time.perf_counter()
        return True


def single_turn_works(p: dict, prompts: list[list[int]], budgets: list[int]) -> list[GroupWork]:
    g, rewards = p["generations"], RewardSet(DEFAULT_WEIGHTS)
    problem = types.SimpleNamespace(prompt_id="p", answer="42", prompt="")
    return [GroupWork(types.SimpleNamespace(**{**vars(problem), "prompt_id": f"p{k}"}), prompts[k * g], g, rewards,
                      f"bench/sampler-0/{k}", k, jax.random.fold_in(jax.random.key(p["seed"]), k),
                      budgets=budgets[k * g:(k + 1) * g]) for k in range(len(prompts) // g)]


class NewVersions:
    """A new weight version every `every_s` seconds (a copy of the weights, so the engine lays it out anew, as it
    does a real one), staged as the sampler stages fetched ones (sampler_service/weights_in_use.py StagedWeights)."""

    def __init__(self, params, every_s: float, mode: str):
        self.params, self.every_s, self.installed = params, every_s, 0
        self.staged = StagedWeights(mode, self._install, lambda: self.staged.stream.episodes_in_flight == 0)
        self._stop = threading.Event()

    def _install(self, got) -> None:
        self.installed += 1

    def run(self) -> None:
        version = 0
        while not self._stop.wait(self.every_s):
            version += 1
            params = jax.tree_util.tree_map(lambda x: x * 1.0, self.params)
            self.staged.stage(Installed(version, params, False, 0.0, 0))

    def __enter__(self):
        self._thread = threading.Thread(target=self.run, name="bench-versions", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def stream_arm(engine, params, works: list[GroupWork], rollouts, rows_in_flight: int, tokenizer, limits,
               versions: NewVersions | None = None) -> dict:
    """The sampler's stream over `works`, fed as room frees (none while a drain waits for a new version), scored
    (in a reward worker, as a sampler scores) and sunk group by group; `versions`: new weight versions arriving while
    it runs."""
    slots = engine.slots
    sink_client = AckingSink(limits)
    sink = GroupSink(sink_client, SamplerMetrics("bench"), tokenizer, "sampler-0", 0.0, abandon=lambda: False,
                     rewards=RewardWorker(RewardSet(DEFAULT_WEIGHTS).functions, 10.0))
    stream = RolloutStream(engine.request_keys, sink.put)
    refresh = lambda: None  # noqa: E731 - a sampler always hands the engine its weight check
    if versions is not None:
        versions.staged.stream, refresh = stream, versions.staged.refresh
    pending = collections.deque(works)
    with Busy() as busy:
        engine_thread = EngineThread(engine, params, stream, refresh, 0, "bench-engine")
        while pending or stream.episodes_in_flight:
            while pending and stream.room(rows_in_flight, slots) >= pending[0].rows and not (
                    versions is not None and versions.staged.waiting()):
                stream.start(pending.popleft(), rollouts)
            stream.wait_change(0.02)
            engine_thread.check()
        stream.close()
        engine_thread.join()
        sink.close(timeout_s=60)
    sink.check()
    if sink_client.acked != len(works):
        raise RuntimeError(f"the stream acknowledged {sink_client.acked} of {len(works)} groups")
    return {"seconds": round(busy.seconds, 3), "tokens": sink_client.tokens, "cores_busy": round(busy.cores, 2),
            "engine_idle_seconds": round(stream.idle_seconds, 3),
            **({"versions_installed": versions.installed} if versions is not None else {})}


def updating_arm(engine, params, works, rollouts, p: dict, tokenizer, limits, mode: str) -> dict:
    with NewVersions(params, p["version_every_s"], mode) as versions:
        return stream_arm(engine, params, works, rollouts, p["rows_in_flight"], tokenizer, limits, versions)


def batch_arm(engine, params, works: list[GroupWork], batch_rows: int, tokenizer, limits) -> dict:
    """The loop the stream replaced: `batch_rows` rows at a time, each batch to its longest row, then scored."""
    sink, per_batch = AckingSink(limits), max(1, batch_rows // works[0].rows)
    with Busy() as busy:
        for start in range(0, len(works), per_batch):
            batch = works[start:start + per_batch]
            out = engine.generate(params, [w.prompt_ids for w in batch for _ in range(w.rows)], batch[0].key,
                                  max_new_tokens=[b for w in batch for b in w.budgets])
            rows = iter(range(len(out.lengths)))
            for work in batch:
                results = [_episode(out, next(rows)) for _ in range(work.rows)]
                sink.put(to_proto(build_group(work, results, "sampler-0", tokenizer)))
    return {"seconds": round(busy.seconds, 3), "tokens": sink.tokens, "cores_busy": round(busy.cores, 2)}


def _episode(out, row: int) -> EpisodeResult:
    n = int(out.lengths[row])
    result = EpisodeResult(finished=bool(out.finished[row]))
    result.add_turn(out.tokens[row, :n], out.logprobs[row, :n], None, result.finished)
    return result


def all_at_once_arm(engine, params, works: list[GroupWork]) -> dict:
    prompts = [w.prompt_ids for w in works for _ in range(w.rows)]
    with Busy() as busy:
        out = engine.generate(params, prompts, works[0].key, max_new_tokens=[b for w in works for b in w.budgets])
    return {"seconds": round(busy.seconds, 3), "tokens": int(out.lengths.sum()), "cores_busy": round(busy.cores, 2)}


def single_turn(p: dict) -> dict:
    """The three single-turn arms on one engine, warmed up once each, then `repeats` alternating rounds."""
    model = build_model({**p, "prompt_high": p["prompt_high"]})
    prompts = make_prompts(p["prompts"], p["generations"], p["prompt_low"], p["prompt_high"], p["vocab_size"],
                           p["seed"])
    budgets = longtail_budgets(len(prompts), p["max_new_tokens"], p["median"], p["sigma"], p["seed"])
    works = single_turn_works(p, prompts, budgets)
    engine = ContinuousEngine(model, 0, NO_EOS, p["prompt_high"], p["max_new_tokens"], 1.0, slots=p["slots"],
                              chunk_steps=p["chunk_steps"])
    limits = GroupLimits(p["generations"], p["prompt_high"], p["max_new_tokens"], p["vocab_size"])
    tokenizer, rollouts = Digits(), SingleTurn(p["max_new_tokens"])
    arms = {"all_at_once": lambda: all_at_once_arm(engine, model.params, works),
            "stream": lambda: stream_arm(engine, model.params, works, rollouts, p["rows_in_flight"], tokenizer,
                                         limits),
            "batch_loop": lambda: batch_arm(engine, model.params, works, p["batch_rows"], tokenizer, limits),
            "updates_in_flight": lambda: updating_arm(engine, model.params, works, rollouts, p, tokenizer, limits,
                                                      "in_flight"),
            "updates_drain": lambda: updating_arm(engine, model.params, works, rollouts, p, tokenizer, limits,
                                                  "drain")}
    runs = _alternate(arms, p["repeats"], "single turn", engine, p["warmup_rounds"])
    rate = {arm: statistics.median(r["tokens"] / r["seconds"] for r in rs) for arm, rs in runs.items()}
    return {"useful_tokens": int(sum(budgets)), "rows": len(prompts), "budget_median": int(np.median(budgets)),
            "budget_max": int(max(budgets)), "tokens_per_second": {a: round(v, 1) for a, v in rate.items()},
            "stream_over_all_at_once": round(rate["stream"] / rate["all_at_once"], 3),
            "stream_over_batch_loop": round(rate["stream"] / rate["batch_loop"], 3),
            "drain_over_in_flight": round(rate["updates_drain"] / rate["updates_in_flight"], 3),
            "version_every_s": p["version_every_s"],
            "stream_engine_idle_share": round(statistics.median(r["engine_idle_seconds"] / r["seconds"]
                                                                for r in runs["stream"]), 4),
            "runs": runs, "engine": {"slots": p["slots"], "chunk_steps": p["chunk_steps"],
                                     "programs_compiled": len(engine.programs)},
            "model": {"parameters": model.num_params()}}


def multi_turn(p: dict) -> dict:
    """Multi-turn episodes with an instant and a 100 ms tool through the stream (the module docstring)."""
    cfg = load_config(DEMO)
    task = build_task(cfg)
    tokenizer = build_tokenizer(cfg, task)
    shape = {**multiturn.QUICK}
    max_prompt, g = cfg.generation.max_prompt_tokens, p["generations"]
    model = multiturn.build_model(shape, tokenizer.vocab_size, max_prompt + p["mt_episode_tokens"])
    engine = ContinuousEngine(model, tokenizer.pad_id, tokenizer.eos_ids, max_prompt, p["mt_episode_tokens"], 1.0,
                              slots=p["mt_slots"], chunk_steps=p["mt_chunk_steps"])
    problems = [task.train_problem(i) for i in range(p["mt_groups"])]
    turns = np.random.default_rng(p["seed"]).integers(3, 6, len(problems) * g).tolist()
    works = [GroupWork(types.SimpleNamespace(index=k * g, prompt_id=pr.prompt_id, prompt=pr.prompt, answer=pr.answer),
                       tokenizer.encode(pr.prompt), g, RewardSet(DEFAULT_WEIGHTS), f"bench/sampler-0/{k}", k,
                       jax.random.fold_in(jax.random.key(p["seed"]), k)) for k, pr in enumerate(problems)]
    limits = GroupLimits(g, max_prompt, p["mt_episode_tokens"], tokenizer.vocab_size)

    def arm(latency: float):
        settings = EpisodeSettings(max_turns=5, turn_max_new_tokens=p["mt_turn_tokens"],
                                   episode_tokens=p["mt_episode_tokens"], tool_latency_s=latency)
        kind = ToolTurns(RowTools(turns), PlainRenderer(tokenizer), settings, tokenizer, p["mt_workers"])
        steps = engine.stats["decode_steps"]
        try:
            run = stream_arm(engine, model.params, works, kind, p["mt_rows_in_flight"], tokenizer, limits)
        finally:
            kind.close()
        # a turn's decode time: its steps at the run's mean step time (the engine's time over its decode steps)
        step_s = (run["seconds"] - run["engine_idle_seconds"]) / max(1, engine.stats["decode_steps"] - steps)
        return {**run, "step_seconds": round(step_s, 5), "turn_seconds": round(step_s * p["mt_turn_tokens"], 4)}

    runs = _alternate({"zero": lambda: arm(0.0), "latency": lambda: arm(p["mt_latency_s"])}, p["repeats"],
                      "multi-turn", engine, p["mt_warmup_rounds"])
    rate = {a: statistics.median(r["tokens"] / r["seconds"] for r in rs) for a, rs in runs.items()}
    return {"ratio_latency_over_zero": round(rate["latency"] / rate["zero"], 3),
            # the shape: a turn decodes faster than the tool answers (zero-latency runs' step time x turn tokens)
            "turn_seconds": statistics.median(r["turn_seconds"] for r in runs["zero"]),
            "engine_idle_share": round(statistics.median(r["engine_idle_seconds"] / r["seconds"]
                                                         for r in runs["latency"]), 4),
            "tokens_per_second": {a: round(v, 1) for a, v in rate.items()}, "episodes": len(works) * g,
            "tool_latency_s": p["mt_latency_s"], "rows_in_flight": p["mt_rows_in_flight"], "slots": p["mt_slots"],
            "runs": runs, "model": {"parameters": model.num_params()}}


class RowTools:
    """The multi-turn benchmark's scripted tool: row r of the group of problem.index makes turns[index + r] model
    turns (rows start in order: the feeder starts a group's rows one after another)."""

    def __init__(self, turns: list[int]):
        self.turns, self._started = turns, collections.Counter()

    def start(self, problem):
        row = self._started[problem.index]
        self._started[problem.index] += 1
        return multiturn.ToolEpisode(self.turns[problem.index + row])


def _alternate(arms: dict, repeats: int, label: str, engine, warmup_rounds: int) -> dict:
    """Untimed rounds of every arm until one compiles nothing (each new slot count, window or prompt bucket the
    stream's timing leads to is a new program) or `warmup_rounds` ran; then `repeats` alternating timed rounds,
    each recording the programs it still compiled."""
    for round_ in range(1, warmup_rounds + 1):
        before = len(engine.programs)
        for name, arm in arms.items():
            _say(f"{label}: {name} warm-up {round_} {arm()}")
        if len(engine.programs) == before:
            break
    runs = {name: [] for name in arms}
    for i in range(repeats):
        for name, arm in arms.items():
            before = len(engine.programs)
            runs[name].append({**arm(), "new_programs": len(engine.programs) - before})
            _say(f"{label}: {name} run {i + 1}/{repeats}: {runs[name][-1]}")
    return runs


def _say(message: str) -> None:
    print(f"bench rollouts: {message}", file=sys.stderr, flush=True)


def run(quick: bool = False, parts: tuple[str, ...] = ("single_turn", "multiturn")) -> dict:
    p = QUICK if quick else FULL
    single = single_turn(p) if "single_turn" in parts else {}
    multi = multi_turn(p) if "multiturn" in parts else {}
    return {"benchmark": "rollouts", "quick": quick,
            "stream_over_all_at_once": single.get("stream_over_all_at_once"),
            "stream_over_batch_loop": single.get("stream_over_batch_loop"), "single_turn": single, "multiturn": multi,
            "workload": {k: v for k, v in p.items() if k not in multiturn.SHAPE_KEYS}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small models and workloads, one run per arm")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/bench/rollouts.json"))
    parser.add_argument("--only", choices=["single_turn", "multiturn"], help="run one part (default: both)")
    args = parser.parse_args(argv)
    result = run(args.quick, (args.only,) if args.only else ("single_turn", "multiturn"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, to_json(result, indent=2) + "\n")  # whole, and strict JSON (files.py)
    multi = result["multiturn"]
    _say(f"stream / all at once {result['stream_over_all_at_once']} (>= 0.9), stream / batch loop "
         f"{result['stream_over_batch_loop']} (>= 2), multi-turn latency / zero "
         f"{multi.get('ratio_latency_over_zero')} (>= 0.8), engine idle {multi.get('engine_idle_share')} (<= 0.05); "
         f"wrote {args.out}")


if __name__ == "__main__":
    main()
