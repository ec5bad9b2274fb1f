"""Benchmark: a sampler's start-up to its first generated group, with a cold and a warm compilation cache.

Setup: an embedded Redis and one `grpo-stream trainer` process on the smoke config (RL only: no warm start, no
evaluation; auth tokens on, as `up` runs it) that has published its first weights and then waits: its step needs
more groups than the benchmark makes, so no training competes with the sampler for the CPU.
Then a `grpo-stream sampler` process starts with an empty runtime.compilation_cache_dir (cold: every program
compiles), runs until its log says "first group generated", and is stopped (SIGTERM); the same command starts
again on the directory the cold run filled (warm: programs are read back). The time measured is wall time from
starting the process (`Popen`) to that log line: interpreter start, imports, tokenizer, model, connecting,
fetching and installing the trainer's weights, compiling (or loading) and running the first generation batch.
Cold and warm alternate, each cold run on a fresh directory; medians are compared, `cold_over_warm` is the
speed-up. Each run also records what the cache did (the sampler's own count at exit: programs loaded and
written) and the cache entries on disk.
"""

from __future__ import annotations

import os
import pathlib
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from grpo_stream.common.rpc.auth import write_tokens
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny_arith_smoke.yaml"
FIRST_GROUP = "first group generated"
IDLE_STEP_GROUPS = 1024  # a sampler run makes 4-8 groups: the trainer never completes a step
CACHE_LINE = re.compile(r"compilation cache \S+: (\d+) of (\d+) programs loaded, (\d+) compiled and written")


class _Process:
    """A child whose output lines are read by a thread, so the caller can wait for one with a deadline."""

    def __init__(self, cmd: list[str], env: dict[str, str]):
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self.lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put((time.perf_counter(), line))
        self.lines.put((time.perf_counter(), None))

    def wait_for(self, text: str, timeout_s: float) -> float:
        """Seconds from the start of the process to the first output line containing `text`."""
        deadline = time.perf_counter() + timeout_s
        while True:
            try:
                at, line = self.lines.get(timeout=max(deadline - time.perf_counter(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"no {text!r} within {timeout_s:.0f}s: {''.join(self.output[-20:])}") from None
            if line is None:
                raise RuntimeError(f"exited ({self.proc.wait()}) before {text!r}: {''.join(self.output[-20:])}")
            self.output.append(line)
            if text in line:
                return at - self.started

    def stop(self) -> str:
        """SIGTERM, wait, and return the output it wrote after the last line read."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        rest = []
        while True:
            try:
                _, line = self.lines.get(timeout=5)
            except queue.Empty:
                break
            if line is None:
                break
            rest.append(line)
        self.output.extend(rest)
        return "".join(rest)


def _sampler_run(cmd: list[str], env: dict[str, str], cache_dir: pathlib.Path, timeout_s: float) -> dict:
    sampler = _Process([*cmd, f"runtime.compilation_cache_dir={cache_dir}"], env)
    try:
        seconds = sampler.wait_for(FIRST_GROUP, timeout_s)
    finally:
        tail = sampler.stop()
    found = CACHE_LINE.search(tail)
    if not found:
        raise RuntimeError(f"the sampler logged no compilation cache summary at exit: {tail[-2000:]}")
    loaded, lookups, written = map(int, found.groups())
    return {"seconds": round(seconds, 2), "programs": lookups, "loaded": loaded, "written": written,
            "entries": sum(1 for _ in cache_dir.glob("*-cache"))}


def check_cache(runs: dict[str, list[dict]]) -> None:
    """A cold run loads nothing and writes what it compiles; its warm run loads some of it and compiles again none of
    it. A warm run may still compile programs new to the cache: each run stops at a SIGTERM after its first group,
    and the shapes its engine reached by then (its slot table grows and shrinks with the rows waiting) depend on
    timing (warm runs compiled 3 programs of 31 that their cold runs had not reached in 2 of 3 quick runs,
    2026-11-29)."""
    for cold, warm in zip(runs["cold"], runs["warm"]):
        if cold["loaded"] or cold["entries"] != cold["written"]:
            raise RuntimeError(f"the cold run loaded programs, or its cache holds others than it wrote: {cold}")
        if (not warm["loaded"] or warm["loaded"] + warm["written"] != warm["programs"]
                or warm["entries"] != cold["entries"] + warm["written"]):
            raise RuntimeError(f"the warm run did not load what its cold run wrote, or compiled some of it again "
                               f"(cold {cold}, warm {warm})")


def run(quick: bool = False) -> dict:
    repeats = 1 if quick else 5
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-startup-"))
    tokens = write_tokens(tmp / "auth")
    redis = EmbeddedRedis().start()
    overrides = [f"redis.url={redis.url}", "redis.allow_unsafe_persistence=true", f"trainer.port={free_port()}", "sampler.replicas=1",
                 "warmstart.steps=0", "trainer.eval_before=false", "trainer.eval_after=false",
                 f"trainer.groups_per_step={IDLE_STEP_GROUPS}", f"buffer.max_groups={4 * IDLE_STEP_GROUPS}",
                 "trainer.metrics_port=null", "sampler.metrics_port=null", "run.name=bench-startup"]

    def command(name: str, options: list[str], extra: list[str]) -> list[str]:
        return [sys.executable, "-m", "grpo_stream", name, "--config", str(CONFIG), *options, *overrides, *extra]

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the trainer compiles without a cache: the same work in every round
    trainer = _Process(command("trainer", ["--run-dir", str(tmp / "run")],
                               ["runtime.compilation_cache_dir=none"]),
                       {**env, "GRPO_STREAM_TOKENS_FILE": str(tokens["table"])})
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    try:
        trainer.wait_for("published weight version", 300)
        sampler_env = {**env, "GRPO_STREAM_TOKEN_FILE": str(tokens["sampler"])}
        sampler = command("sampler", ["--index", "0"], [])
        for i in range(repeats):
            cache_dir = tmp / f"cache-{i}"  # fresh for the cold run, then the warm run reads what it wrote
            for mode in ("cold", "warm"):
                runs[mode].append(_sampler_run(sampler, sampler_env, cache_dir, 300))
                print(f"bench startup: {mode} run {i + 1}/{repeats}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    finally:
        trainer.stop()
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    cold = statistics.median(r["seconds"] for r in runs["cold"])
    warm = statistics.median(r["seconds"] for r in runs["warm"])
    check_cache(runs)
    return {"benchmark": "startup", "quick": quick, "repeats": repeats, "config": str(CONFIG.relative_to(ROOT)),
            "cold_seconds": round(cold, 2), "warm_seconds": round(warm, 2),
            "cold_over_warm": round(cold / warm, 2), "saved_seconds": round(cold - warm, 2), "runs": runs}
