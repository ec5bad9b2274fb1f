"""Benchmark (issue 24's soak): the demo loop under `up` for --minutes while --clients prompt-injection clients
submit and follow prompts; the memory of every process and Redis's `used_memory` must plateau.

Each client thread has its own channel and loops: Submit one prompt (alternately train=true and train=false), then
StreamResults until the samplers answer it. Snapshots: after --baseline-minutes of RL (start-up, compilation and the
first checkpoints are behind it), then every minute to the end: the resident set and thread count of each process
`up` started (trainer, samplers, embedded Redis) and Redis INFO used_memory, with the audit trail's sizes. Target:
every value within 15% of its baseline, judged on peaks: the peak over the last third of the measured span
against the peak over its first third (`envelope_growth`; the two single samples' ratio is kept as point_growth). Afterwards `up` is stopped with Ctrl-C (exit 130) and `grpo-stream audit` must find the run clean.

    python -m grpo_stream.bench.soak [--minutes 20] [--clients 32] [--baseline-minutes 5] [--out F] [--quick]
                                     [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import redis

from grpo_stream.common.rollouts.buffer import keys
from grpo_stream.common.rollouts.redis_protection import read_password
from grpo_stream.common.rpc.grpc_util import ClientSecurity, open_channel
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc
from grpo_stream.common.runtime.files import write_atomic
from grpo_stream.reports.run_report import read_metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
GROWTH_BOUND = 1.15
SAMPLE_S = 20.0


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc), depth first."""
    parent_of = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent_of[int(entry.name)] = int(fields[1])
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        kids = [p for p, parent in parent_of.items() if parent == current]
        out += kids
        todo += kids
    return out


def _name(pid: int) -> str:
    args = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    words = [a.decode(errors="replace") for a in args if a]
    if any("redis-server" in w for w in words[:1]):
        return "redis"
    for role in ("trainer", "ingest"):
        if role in words:
            return role
    if "sampler" in words:
        return f"sampler-{words[words.index('--index') + 1]}" if "--index" in words else "sampler"
    return " ".join(words[:3])[:40]


def _status(pid: int) -> tuple[float, int]:
    """(resident set in MB, threads) of `pid`."""
    rss, threads = 0.0, 0
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, threads


def snapshot(up_pid: int, client: redis.Redis, run: str) -> dict:
    rss, threads = {"up": round(_status(up_pid)[0], 1)}, {}
    for pid in _children(up_pid):
        try:
            name = _name(pid)
            if name in ("trainer", "ingest", "redis") or name.startswith("sampler"):
                mb, n = _status(pid)
                rss[name], threads[name] = round(mb, 1), n
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
    k = keys("grpo-stream", run)
    info = client.info("memory")
    last = client.xrevrange(k["audit:steps"], count=1)
    return {"t": time.time(), "rss_mb": rss, "threads": threads, "redis_used_memory": int(info["used_memory"]),
            "audit_accepted": client.hlen(k["audit:accepted"]), "audit_settled": client.hlen(k["audit:settled"]),
            "audit_steps": client.xlen(k["audit:steps"]), "trainer_step": int(last[0][1][b"step"]) if last else 0,
            "counters": {
                key.decode(): int(v) for key, v in client.hgetall(k["counters"]).items()}}


def _values(snap: dict) -> dict[str, float]:
    return {**snap["rss_mb"], "redis_used_memory": snap["redis_used_memory"]}


def envelope_growth(series: list[dict]) -> dict[str, float]:
    """Per process (and Redis used_memory): the peak over the last third of the measured span over the peak over
    its first third. The trainer's resident set swings by ~230 MB within minutes (measured: 565-795 MB, a
    sawtooth), so the end-over-baseline ratio of two single samples says which phase each fell in, not whether
    memory grows; the envelope's peaks do."""
    t0, t1 = series[0]["t"], series[-1]["t"]
    if len(series) < 2 or t1 <= t0:  # one sample is its own peak in both thirds: a growth of 1.0, measured on nothing
        raise ValueError("envelope_growth: no snapshot after the baseline; give --minutes more than "
                         "--baseline-minutes")
    third = (t1 - t0) / 3
    first = [_values(s) for s in series if s["t"] <= t0 + third]
    last = [_values(s) for s in series if s["t"] >= t1 - third]
    out = {}
    for name in first[0]:
        early = max(v.get(name, 0.0) for v in first)
        late = max(v.get(name, 0.0) for v in last)
        if early > 0:
            out[name] = round(late / early, 3)
    return out


def completion_lengths(metrics: pathlib.Path, every: int = 100) -> list[dict]:
    """Mean completion length and truncated share per `every` RL steps: what each kept prompt's result holds grows
    with it, so Redis under the count bound moves with the policy's lengths (seen: 7 -> 18 tokens at step ~1350)."""
    if not metrics.exists():
        return []
    rows = [r for r in read_metrics(metrics) if "train/response_length_mean" in r]  # torn lines skipped
    out = []
    for start in range(0, max((r["step"] for r in rows), default=0) + 1, every):
        window = [r for r in rows if start <= r["step"] < start + every]
        if window:
            out.append({"from_step": start, "length": round(sum(r["train/response_length_mean"] for r in window)
                                                            / len(window), 2),
                        "truncated": round(sum(r["train/truncated_fraction"] for r in window) / len(window), 3)})
    return out


def _client(address: str, token: str, stop: threading.Event, out: dict, index: int) -> None:
    channel = open_channel(address, ClientSecurity(token))
    stub = prompts_pb2_grpc.PromptServiceStub(channel)
    n = 0
    while not stop.is_set():
        a, b = 10 + (index * 7 + n) % 80, 10 + (index * 3 + n * 5) % 80
        try:
            reply = stub.Submit(prompts_pb2.SubmitRequest(prompts=[prompts_pb2.PromptSpec(
                question=f"{a} + {b} = ?", reference_answer=str(a + b), train=n % 2 == 0, tags=[f"soak-{index}"])]),
                timeout=10)
            results = list(stub.StreamResults(prompts_pb2.ResultsRequest(prompt_ids=reply.prompt_ids), timeout=120))
            out["answered" if results and results[0].state == "done" else "unanswered"] += 1
        except grpc.RpcError as exc:
            if not stop.is_set():
                out["errors"] += 1
                out["last_error"] = f"{exc.code().name}: {exc.details()}"
                time.sleep(1)
        n += 1
    channel.close()


def _wait(what: str, check, seconds: float, proc: subprocess.Popen, log: pathlib.Path) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"soak: {what} did not happen; up's log ends:\n{log.read_text()[-3000:]}")
        time.sleep(1)


def run(minutes: float = 20.0, clients: int = 32, baseline_minutes: float = 5.0, quick: bool = False,
        extra: list[str] | None = None) -> dict:
    if quick:  # a check that it works: memory figures need the full run, learning none of it
        minutes, clients, baseline_minutes = 1.0, 4, 0.5
    if not 0 <= baseline_minutes < minutes:  # before `up` starts: else no snapshot follows the baseline
        raise ValueError(f"--baseline-minutes {baseline_minutes} must be at least 0 and less than --minutes {minutes}: "
                         "memory is measured from the baseline to the end")
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="bench-soak-")) / "run"
    log = run_dir.parent / "up.log"
    overrides = ["trainer.steps=10000000", "warmstart.steps=50", "trainer.eval_before=false",
                 "trainer.eval_after=false", "trainer.metrics_port=null", "sampler.metrics_port=null",
                 "prompts.max_pending_per_client=1000", *(["warmstart.steps=5"] if quick else []), *(extra or [])]
    with log.open("w") as out:
        up = subprocess.Popen([sys.executable, "-m", "grpo_stream", "up", "--config", str(ROOT / "configs" /
                                                                                          "tiny_arith.yaml"),
                               "--run-dir", str(run_dir), *overrides], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stop = threading.Event()
    counts = [{"answered": 0, "unanswered": 0, "errors": 0} for _ in range(clients)]
    threads: list[threading.Thread] = []
    try:
        # the first step trained, not only started: start-up and compilation are behind the baseline
        _wait("the first RL step", lambda: "step 1/" in log.read_text(), 900, up, log)
        address = re.search(r"gRPC server \(ingest, prompts[^)]*\) on (\S+:\d+)", log.read_text()).group(1)
        info = json.loads((run_dir / "run.json").read_text())
        client = redis.Redis.from_url(info["redis_url"], password=read_password(run_dir / "redis"))  # up's is protected
        token = (run_dir / "auth" / "client.token").read_text().strip()
        threads = [threading.Thread(target=_client, args=(address, token, stop, counts[i], i),
                                    daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        started = time.monotonic()
        print(f"[soak] RL started; {clients} clients; baseline in {baseline_minutes} min, end in {minutes} min",
              flush=True)
        time.sleep(baseline_minutes * 60)
        baseline = snapshot(up.pid, client, info["run"])
        series, printed = [baseline], time.monotonic()  # two points cannot tell a sawtooth from a climb
        while (left := minutes * 60 - (time.monotonic() - started)) > 0:
            time.sleep(min(SAMPLE_S, left))
            series.append(snapshot(up.pid, client, info["run"]))
            if time.monotonic() - printed >= 59 or left <= SAMPLE_S:
                printed = time.monotonic()
                print(f"[soak] {(printed - started) / 60:.1f} min: answered {sum(c['answered'] for c in counts)}, "
                      f"RSS MB {series[-1]['rss_mb']}, threads {series[-1]['threads']}, Redis used_memory "
                      f"{series[-1]['redis_used_memory'] / 2**20:.1f} MB", flush=True)
        end = series[-1]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=130)
        up.send_signal(signal.SIGINT)
        try:
            up.wait(600)
        except subprocess.TimeoutExpired:
            up.kill()
    audit = subprocess.run([sys.executable, "-m", "grpo_stream", "audit", str(run_dir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    point_growth = {name: round(end["rss_mb"][name] / mb, 3) for name, mb in baseline["rss_mb"].items()
                    if name in end["rss_mb"] and mb > 0}
    point_growth["redis_used_memory"] = round(end["redis_used_memory"] / baseline["redis_used_memory"], 3)
    growth = envelope_growth(series)
    lengths = completion_lengths(run_dir / "metrics-trainer.jsonl")
    return {"benchmark": "soak", "quick": quick, "minutes": minutes, "clients": clients,
            "baseline_minutes": baseline_minutes, "overrides": overrides, "baseline": baseline, "end": end,
            "series": series, "growth": growth, "point_growth": point_growth, "completion_lengths": lengths,
            "max_growth": max(growth.values()), "steps_between": end["trainer_step"] - baseline["trainer_step"],
            "prompts_answered": sum(c["answered"] for c in counts),
            "prompts_unanswered": sum(c["unanswered"] for c in counts),
            "client_errors": sum(c["errors"] for c in counts),
            "last_client_error": next((c["last_error"] for c in counts if "last_error" in c), None),
            "up_exit_code": up.returncode, "audit_ok": audit.returncode == 0, "audit": audit.stdout[-1500:],
            "targets": {"max_growth": {"value": max(growth.values()), "bound": GROWTH_BOUND,
                                       "met": max(growth.values()) <= GROWTH_BOUND}}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, help="the whole run, from the first RL step (default 20)")
    parser.add_argument("--clients", type=int, help="prompt clients (default 32)")
    parser.add_argument("--baseline-minutes", type=float, help="first snapshot, from the first RL step (default 5)")
    parser.add_argument("--quick", action="store_true", help="1 minute, 4 clients, baseline at 30 s, 5 warm-start "
                        "steps (a check)")
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another config override for the run (repeatable)")
    args = parser.parse_args(argv)
    defaults = {"minutes": 20.0, "clients": 32, "baseline_minutes": 5.0}
    given = [f"--{k.replace('_', '-')}" for k in defaults if getattr(args, k) is not None]
    if args.quick and given:  # --quick sets all three: a figure given beside it would be silently dropped
        parser.error(f"--quick sets its own {', '.join(given)}: drop one or the other")
    minutes, clients, baseline = (defaults[k] if getattr(args, k) is None else getattr(args, k) for k in defaults)
    if not 0 <= baseline < minutes:
        parser.error(f"--baseline-minutes {baseline} must be at least 0 and less than --minutes {minutes}: memory "
                     "is measured from the baseline to the end")
    result = run(minutes, clients, baseline, args.quick, args.set)
    text = json.dumps(result, indent=2)
    if args.out:
        write_atomic(args.out, text)
    print(json.dumps({k: result[k] for k in ("growth", "max_growth", "steps_between", "prompts_answered",
                                             "client_errors", "audit_ok")}, indent=2))
    return 0 if result["audit_ok"] and result["up_exit_code"] == 130 else 1  # 130: up stopped by Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
