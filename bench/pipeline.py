"""Benchmark: how much of the trainer's main-thread wall time is not compute, when data never runs short.

The real trainer (ingest gRPC server, Redis buffer, decode, batching, the jitted
update, weight publication, metrics) runs in this process on the demo config
(`configs/tiny_arith.yaml`, RL only). A synthetic producer thread streams random
but valid groups, stamped with the newest published version, through the real
sampler client into the ingest, fast enough that the buffer is never empty.

One trainer run switches `trainer.prefetch_plans` every `block` steps (10; quick:
3): on (step n+1's plan made on the prefetch thread while step n computes), then
off (each plan made on the main thread between updates), and so on, so both modes
see the same load (on a machine others share, it drifts over minutes). A step
counts as "on" when its own plan and the next one were made ahead (it waited for a
prefetch, and a prefetch ran beside its update), "off" when neither was; the steps
at a switch count in neither. Per step the trainer records its main thread's
phases, which sum to its wall time there (`step_seconds`): plan_wait (getting the
step's plan: with prefetch off, making it: collect, batch and pack; on, waiting for
the prefetch thread), publish_wait (the previous publication, before a donating
update), compute (the update: placing the packed batch, the jitted programs, the
metrics back) and handoff (settling the trained groups, handing publication and
reporting to the trainer's worker threads); and the plan's own collect (waiting
for, reading and decoding groups), batch and pack (the batch packed into the
update's rows) seconds, which with prefetch on ran beside the previous update
(`overlapped_share`) and are not main-thread time.

`overhead_share` = 1 - compute / main-thread step wall time, summed over the "on"
steps after the first `warmup` (which include compilation);
`prefetch_off.overhead_share` over the "off" steps beside it. Host work moved
beside the update can still slow the update down (the machine's cores are shared
by XLA's compute threads and the prefetch thread): `compute_seconds_per_step`
(median, off and on) with `compute_slowdown` (on / off), and
`median_step_seconds` with `step_ratio` (on / off: below 1, prefetch made steps
shorter), show it.

Two settings differ from the demo so the producer can stay ahead: the buffer
holds three steps of groups (demo: one, to bound staleness) and the ingest asks
for retries after 5 ms (demo: 200 ms).
"""

from __future__ import annotations

import pathlib
import statistics
import tempfile
import threading
import time

import numpy as np

from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rpc.auth import write_tokens
from grpo_stream.common.rpc.grpc_util import ClientSecurity, open_channel
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis
from grpo_stream.common.rollouts.wire import CompletionData, GroupData, to_proto
from grpo_stream.sampler_service.rollout_client import RolloutClient
from grpo_stream.trainer_service.loop import Trainer

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_arith.yaml"
MAIN_THREAD = ("plan_wait_seconds", "publish_wait_seconds", "compute_seconds", "handoff_seconds")
PREPARE = ("collect_seconds", "batch_seconds", "pack_seconds")  # the plan's making, wherever it ran


def _random_group(rng: np.random.Generator, cfg, vocab: int, pad_id: int, index: int, version: int) -> GroupData:
    gen = cfg.generation
    prompt = rng.integers(0, vocab, rng.integers(4, gen.max_prompt_tokens + 1)).astype(np.int32)
    prompt[prompt == pad_id] = (pad_id + 1) % vocab
    completions = []
    for _ in range(gen.num_generations):
        n = int(rng.integers(1, gen.max_new_tokens + 1))
        tokens = rng.integers(0, vocab, n).astype(np.int32)
        tokens[tokens == pad_id] = (pad_id + 1) % vocab
        correct = float(rng.random() < 0.5)
        completions.append(CompletionData(tokens, -rng.random(n, dtype=np.float32) * 3, correct, n == gen.max_new_tokens,
                                          {"answer_correct": correct}))
    # a sampler's ids, as its token allows: sampler id sampler-0, group ids '<run>/sampler-0/<data position>'
    return GroupData(f"{cfg.run.name}/sampler-0/{index}", f"p{index}", prompt, completions, version, "sampler-0",
                     data_position=index)


def _produce(trainer: Trainer, stop: threading.Event, errors: list) -> None:
    """Stream valid random groups at the newest version until told to stop."""
    try:
        s = trainer.s  # process 0's services (loop.LeaderServices): set up by trainer.run
        while s.server is None or s.publisher is None or s.publisher.latest_version is None:
            if stop.wait(0.01):
                return
        cfg, tokenizer = trainer.cfg, trainer.core.parts.tokenizer
        channel = open_channel(f"127.0.0.1:{s.server.port}", ClientSecurity(trainer.bench_token))
        client = RolloutClient(channel, backlog_max_groups=cfg.trainer.groups_per_step,
                               max_groups_per_message=cfg.trainer.groups_per_step).start()
        rng = np.random.default_rng(0)
        vocab, pad = tokenizer.vocab_size, tokenizer.pad_id
        templates = [_random_group(rng, cfg, vocab, pad, i, 0) for i in range(64)]
        index = 0
        while not stop.is_set():
            group = templates[index % len(templates)]
            group.group_id, group.data_position = f"{cfg.run.name}/sampler-0/{index}", index
            group.policy_version = s.publisher.latest_version or 0
            if client.put(to_proto(group), timeout_s=0.1):
                index += 1
        client.close()
        channel.close()
    except Exception as exc:  # noqa: BLE001 - reported by run()
        errors.append(exc)


def run(quick: bool = False, overrides: tuple[str, ...] = (), steps: int | None = None,
        alternate: bool = True) -> dict:
    """`overrides`: config overrides on top of the benchmark's (bench/eval_during.py: eval.every_steps); `steps`:
    instead of the mode's; `alternate=False`: the prefetch as configured all run long, the figures of all steps."""
    steps, warmup, block = (steps or 16, 4, 3) if quick else (steps or 150, 10, 10)
    # figures need timed steps past the warm-up; alternating, a block with prefetch on and one off, and the switches
    least = warmup + (2 * block + 2 if alternate else 1)
    if steps < least:
        raise ValueError(f"steps={steps}: none or too few left to time after {warmup} warm-up steps"
                         f"{f' in blocks of {block}' if alternate else ''}; give at least {least}")
    started = time.perf_counter()
    timed, summary, cfg = _run_trainer(steps, block if alternate else None, overrides)
    timed = timed[warmup:]
    common = {"benchmark": "pipeline", "quick": quick, "config": str(CONFIG.relative_to(ROOT)), "steps": steps,
              "steps_timed": len(timed), "groups_per_step": cfg.trainer.groups_per_step,
              "groups_dropped_stale": summary["groups_dropped_stale"],
              "eval_curve_steps": [row["step"] for row in summary.get("eval_curve", [])],
              "eval_skipped": summary.get("eval_skipped", []), "eval_errors": summary.get("eval_errors", 0)}
    if not alternate:
        return {**common, **figures(timed), "wall_seconds": round(time.perf_counter() - started, 1)}
    # step n is "on" when its own plan and the next one's were made ahead (its wait was a prefetch's, and a prefetch
    # ran beside its update), "off" when neither; the steps where the switch happens count in neither
    on = [t for t, after in zip(timed, timed[1:]) if t["prepared_ahead"] and after["prepared_ahead"]]
    off = [t for t, after in zip(timed, timed[1:]) if not t["prepared_ahead"] and not after["prepared_ahead"]]
    on, off = figures(on), figures(off)
    compute = {"off": off.pop("compute_seconds_per_step"), "on": on.pop("compute_seconds_per_step")}
    step = {"off": off.pop("median_step_seconds"), "on": on.pop("median_step_seconds")}
    return {
        **common, "block": block, **on, "prefetch_off": off, "compute_seconds_per_step": compute,
        "compute_slowdown": round(compute["on"] / compute["off"], 4), "median_step_seconds": step,
        "step_ratio": round(step["on"] / step["off"], 4), "wall_seconds": round(time.perf_counter() - started, 1),
    }


def _alternate(trainer: Trainer, block: int, stop: threading.Event) -> None:
    """Prefetch on for `block` steps, off for the next `block`, and so on (what the next plan submitted does), so
    both see the same load, which on a shared machine drifts over minutes."""
    while not stop.wait(0.02):
        source = trainer.source
        if source is not None and source.prefetch is not None:
            source.prefetch.enabled = (source.steps_done // block) % 2 == 0


def _run_trainer(steps: int, block: int | None, overrides: tuple[str, ...] = ()) -> tuple[list[dict], dict, object]:
    """One trainer run against the producer, prefetch switched every `block` steps (None: as configured): (its steps'
    times, its summary, its config)."""
    embedded = EmbeddedRedis().start()
    stop, errors = threading.Event(), []
    try:
        with tempfile.TemporaryDirectory(prefix="grpo-stream-bench-") as tmp:
            tokens = write_tokens(pathlib.Path(tmp) / "auth")  # auth on, as in a deployment
            cfg = load_config(CONFIG, [
                f"auth.tokens_file={tokens['table']}", f"redis.url={embedded.url}", "redis.allow_unsafe_persistence=true", "run.name=bench-pipeline", "trainer.port=0", "trainer.metrics_port=null",
                "warmstart.steps=0", "trainer.eval_before=false", "trainer.eval_after=false",
                f"trainer.steps={steps}", "trainer.final_wait_s=0", "buffer.max_groups=48", "buffer.retry_after_ms=5",
                *overrides])
            trainer = Trainer(cfg, pathlib.Path(tmp))
            trainer.bench_token = tokens["sampler"].read_text().strip()
            threading.Thread(target=_produce, args=(trainer, stop, errors), daemon=True).start()
            if block is not None:
                threading.Thread(target=_alternate, args=(trainer, block, stop), daemon=True).start()
            summary = trainer.run()
    finally:
        stop.set()
        embedded.stop()
    if errors:
        raise RuntimeError(f"synthetic producer failed: {errors[0]}")
    if summary["steps"] != steps:
        raise RuntimeError(f"trainer stopped after {summary['steps']} of {steps} steps")
    return trainer.step_times, summary, cfg


def figures(timed: list[dict]) -> dict:
    """The figures of a run's timed steps (LeaderSource.step_times): main-thread shares of the step wall time
    (`other`: the loop between phases: sending, recording, heartbeats), and the plan's making, over the same wall
    time, split by where it ran (`overlapped_share`: on the prefetch thread; `main_thread_share` holds it inside
    plan_wait when it ran there)."""
    total = sum(t["step_seconds"] for t in timed)
    share = {p.removesuffix("_seconds"): round(sum(t[p] for t in timed) / total, 4) for p in MAIN_THREAD}
    share["other"] = round(1 - sum(sum(t[p] for p in MAIN_THREAD) for t in timed) / total, 4)
    ahead = [t for t in timed if t["prepared_ahead"]]
    return {
        "steps_counted": len(timed),
        "mean_step_seconds": round(total / len(timed), 4),
        "median_step_seconds": round(statistics.median(t["step_seconds"] for t in timed), 4),
        "overhead_share": round(1 - share["compute"], 4),
        "main_thread_share": share,
        "plans_prepared_ahead": len(ahead),
        "overlapped_share": {p.removesuffix("_seconds"): round(sum(t[p] for t in ahead) / total, 4) for p in PREPARE},
        "prepare_share": {p.removesuffix("_seconds"): round(sum(t[p] for t in timed) / total, 4) for p in PREPARE},
        "compute_seconds_per_step": round(statistics.median(t["compute_seconds"] for t in timed), 4),
    }
