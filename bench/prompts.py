"""Benchmark: 64 concurrent PromptService clients submitting and following for 30 s.

The server is a real `grpo-stream ingest` process (auth on, embedded Redis). Each client thread has its own
channel and token and loops: Submit one prompt, then StreamResults until it is answered. Two answerer threads act
as samplers over the real RPCs (ClaimPrompts, then PushGroup with a scored group per prompt); their completions
are fixed, so the benchmark measures the service, not a model. Reported: submit latency p50/p99, time to result
p50/p99, throughput, errors (any failed RPC or unanswered prompt); baseline in the same run, same clients, same
server: an authenticated grpc.health.v1 Check, so `submit_over_check_p50` is the cost of validation, tokenizing
and the Redis queue over a bare RPC.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpo_stream.common.rpc.auth import write_tokens
from grpo_stream.common.config.loading import load_config
from grpo_stream.common.rpc.grpc_util import ClientSecurity, open_channel
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, free_port
from grpo_stream.common.rollouts.wire import CompletionData, GroupData, to_proto
from grpo_stream.protos import prompts_pb2, prompts_pb2_grpc, rollout_pb2, rollout_pb2_grpc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else float("nan")


def _answerer(address: str, token: str, run: str, sampler: str, stop: threading.Event, counts: dict) -> None:
    channel = open_channel(address, ClientSecurity(token))
    stub = rollout_pb2_grpc.RolloutIngestStub(channel)
    while not stop.is_set():
        try:
            prompts = stub.ClaimPrompts(rollout_pb2.ClaimRequest(sampler_id=sampler, max_prompts=16), timeout=10).prompts
            if not prompts:
                time.sleep(0.01)
                continue
            groups = [to_proto(GroupData(
                f"{run}/inj/{p.prompt_id}", p.prompt_id, np.array(p.prompt_token_ids, np.int32),
                [CompletionData(np.array([5, 6, 7], np.int32), np.full(3, -0.5, np.float32), float(k % 2), False)
                 for k in range(p.num_generations)], 0, sampler, injected=True)) for p in prompts]
            for ack in stub.StreamBatches(iter([rollout_pb2.RolloutBatch(groups=groups)]), timeout=10):
                counts["answered"] += sum(a.code == 0 for a in ack.acks)
        except grpc.RpcError as exc:
            counts["answer_errors"] += 1
            counts["last_answer_error"] = f"{exc.code().name}: {exc.details()}"
    channel.close()


def _client(address: str, token: str, seconds: float, kind: str, out: dict, start: threading.Barrier) -> None:
    channel = open_channel(address, ClientSecurity(token))
    prompts = prompts_pb2_grpc.PromptServiceStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    grpc.channel_ready_future(channel).result(timeout=30)
    start.wait()
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        try:
            if kind == "check":
                health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
                out["latency"].append(time.perf_counter() - t0)
                continue
            reply = prompts.Submit(prompts_pb2.SubmitRequest(prompts=[prompts_pb2.PromptSpec(
                question=f"Mia has {10 + n % 80} pens and gets {n % 50 + 10} more. How many pens now?",
                reference_answer=str(20 + n % 80 + n % 50), tags=["bench"])]), timeout=10)
            out["latency"].append(time.perf_counter() - t0)
            results = list(prompts.StreamResults(prompts_pb2.ResultsRequest(prompt_ids=reply.prompt_ids), timeout=30))
            if len(results) != 1 or results[0].state != "done":
                out["errors"].append(f"prompt {reply.prompt_ids[0]}: {len(results)} results")
            out["to_result"].append(time.perf_counter() - t0)
            n += 1
        except grpc.RpcError as exc:
            out["errors"].append(f"{exc.code().name}: {exc.details()}")
    channel.close()


def _round(address: str, token: str, clients: int, seconds: float, kind: str) -> dict:
    outs = [{"latency": [], "to_result": [], "errors": []} for _ in range(clients)]
    barrier = threading.Barrier(clients)
    threads = [threading.Thread(target=_client, args=(address, token, seconds, kind, outs[i], barrier))
               for i in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    merged = {key: [v for o in outs for v in o[key]] for key in ("latency", "to_result", "errors")}
    merged["elapsed"] = elapsed
    return merged


def run(quick: bool = False) -> dict:
    clients, seconds = (8, 3.0) if quick else (64, 30.0)
    redis = EmbeddedRedis().start()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-prompts-"))
    tokens = write_tokens(tmp / "auth")
    port = free_port()
    overrides = [f"redis.url={redis.url}", "redis.allow_unsafe_persistence=true", "ingest.standalone=true", f"ingest.port={port}", "run.name=bench-prompts",
                 "prompts.max_pending_per_client=100000", "prompts.max_queued=100000", "logging.level=WARNING"]
    cfg = load_config(ROOT / "configs" / "tiny_arith.yaml", overrides)
    server = subprocess.Popen([sys.executable, "-m", "grpo_stream", "ingest", "--config",
                               str(ROOT / "configs" / "tiny_arith.yaml"), *overrides], cwd=ROOT,
                              env={**os.environ, "GRPO_STREAM_TOKENS_FILE": str(tokens["table"])},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    address = f"127.0.0.1:{port}"
    stop = threading.Event()
    counts = {"answered": 0, "answer_errors": 0}
    answerers = [threading.Thread(target=_answerer, args=(address, tokens["sampler"].read_text().strip(),
                                                          cfg.run.name, f"sampler-{i}", stop, counts))
                 for i in range(2)]
    try:
        client_token = tokens["client"].read_text().strip()
        channel = open_channel(address, ClientSecurity(client_token))
        grpc.channel_ready_future(channel).result(timeout=120)  # the ingest builds its tokenizer first
        channel.close()
        for t in answerers:
            t.start()
        check = _round(address, client_token, clients, seconds, "check")
        ours = _round(address, client_token, clients, seconds, "submit")
    finally:
        stop.set()
        for t in answerers:
            t.join(timeout=15)
        server.terminate()
        server.wait(30)
        redis.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the run's token files with it
    errors = ours["errors"] + check["errors"]
    result = {
        "benchmark": "prompts", "quick": quick, "clients": clients, "seconds_per_round": seconds,
        "submits": len(ours["latency"]), "answered": len(ours["to_result"]),
        "submits_per_s": round(len(ours["latency"]) / ours["elapsed"], 1),
        "submit_p50_ms": _percentile(ours["latency"], 50), "submit_p99_ms": _percentile(ours["latency"], 99),
        "to_result_p50_ms": _percentile(ours["to_result"], 50), "to_result_p99_ms": _percentile(ours["to_result"], 99),
        "check_p50_ms": _percentile(check["latency"], 50), "check_p99_ms": _percentile(check["latency"], 99),
        "checks_per_s": round(len(check["latency"]) / check["elapsed"], 1),
        "errors": len(errors) + counts["answer_errors"], "error_examples": errors[:5],
        "answer_errors": counts["answer_errors"], "last_answer_error": counts.get("last_answer_error"),
    }
    result["submit_over_check_p50"] = round(result["submit_p50_ms"] / max(result["check_p50_ms"], 1e-9), 2)
    if not ours["latency"]:
        raise RuntimeError("no Submit completed")
    return result
