"""Benchmark: how much of the trainer's wall time is not compute, when data never runs short.

The real trainer (ingest gRPC server, Redis buffer, decode, batching, the jitted
update, weight publication, metrics) runs in this process on the demo config
(`configs/tiny_arith.yaml`, RL only). A synthetic producer thread streams random
but valid groups, stamped with the newest published version, through the real
sampler client into the ingest, fast enough that the buffer is never empty.

Per step the trainer records collect (waiting for, reading and decoding groups),
batch, pack (the batch packed into the update's rows on the host), compute (the
update: placing the packed batch, the jitted programs, the metrics back) and
handoff (settling the trained groups and handing publication and reporting to the
trainer's worker thread, which overlaps them with the next step) seconds;
`overhead_share` = 1 - compute / step wall time, summed over the steps after the
first `warmup` (which include compilation).

Two settings differ from the demo so the producer can stay ahead: the buffer
holds three steps of groups (demo: one, to bound staleness) and the ingest asks
for retries after 5 ms (demo: 200 ms).
"""

from __future__ import annotations

import pathlib
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
PHASES = ("collect_seconds", "batch_seconds", "publish_wait_seconds", "pack_seconds", "compute_seconds",
          "handoff_seconds")


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
    return GroupData(f"bench/sampler-0/{index}", f"p{index}", prompt, completions, version, "sampler-0",
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
            group.group_id, group.data_position = f"bench/sampler-0/{index}", index
            group.policy_version = s.publisher.latest_version or 0
            if client.put(to_proto(group), timeout_s=0.1):
                index += 1
        client.close()
        channel.close()
    except Exception as exc:  # noqa: BLE001 - reported by run()
        errors.append(exc)


def run(quick: bool = False, overrides: tuple[str, ...] = (), steps: int | None = None) -> dict:
    """`overrides`: config overrides on top of the benchmark's (bench/eval_during.py: eval.every_steps); `steps`:
    instead of the mode's."""
    steps, warmup = (steps or 12, 4) if quick else (steps or 150, 10)
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
            producer = threading.Thread(target=_produce, args=(trainer, stop, errors), daemon=True)
            producer.start()
            started = time.perf_counter()
            summary = trainer.run()
            wall = time.perf_counter() - started
    finally:
        stop.set()
        embedded.stop()
    if errors:
        raise RuntimeError(f"synthetic producer failed: {errors[0]}")
    if summary["steps"] != steps:
        raise RuntimeError(f"trainer stopped after {summary['steps']} of {steps} steps")
    timed = trainer.step_times[warmup:]
    total = sum(t["step_seconds"] for t in timed)
    phase_share = {p: round(sum(t[p] for t in timed) / total, 4) for p in PHASES}
    return {
        "benchmark": "pipeline", "quick": quick, "config": str(CONFIG.relative_to(ROOT)), "steps": steps,
        "steps_timed": len(timed), "groups_per_step": cfg.trainer.groups_per_step,
        "mean_step_seconds": round(total / len(timed), 4),
        "overhead_share": round(1 - phase_share["compute_seconds"], 4),
        "phase_share": phase_share,
        "groups_dropped_stale": summary["groups_dropped_stale"],
        "median_step_seconds": round(float(np.median([t["step_seconds"] for t in timed])), 4),
        "eval_curve_steps": [row["step"] for row in summary.get("eval_curve", [])],
        "eval_skipped": summary.get("eval_skipped", []),
        "eval_errors": summary.get("eval_errors", 0),
        "wall_seconds": round(wall, 1),
    }
