"""Benchmark: rollout groups through the real transport, against JSON, pickle and raw Redis.

Ours: sampler-side gRPC stream -> ingest (validation) -> Redis stream -> trainer-side read + protobuf
decode. Baselines in the same run, same groups, same Redis server (medians of `repeats` interleaved rounds):
  json    the group as a JSON document over a Redis stream (XADD / XREAD + json.loads to arrays)
  pickle  the group object pickled over a Redis stream (how several peers move rollouts)
  raw     XADD / XREAD of our protobuf payload bytes with no gRPC, validation or decode: the ceiling

The pickle baseline only ever unpickles bytes this process just produced.
"""

from __future__ import annotations

import json
import pickle
import statistics
import threading
import time

import grpc
import numpy as np

from grpo_stream.common.rollouts.buffer import RedisStreamBuffer
from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS
from grpo_stream.common.rollouts.redis_server import EmbeddedRedis, connect
from grpo_stream.common.rollouts.wire import CompletionData, GroupData, GroupLimits, decode_group, encode_group, to_proto
from grpo_stream.sampler_service.rollout_client import RolloutClient
from grpo_stream.trainer_service.ingest.rollout_ingest import IngestServicer
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.server import TrainerServer


def make_groups(count: int, completions: int, tokens: int, vocab: int = 32_000) -> list[GroupData]:
    rng = np.random.default_rng(0)
    return [GroupData(
        group_id=f"bench/{i}", prompt_id=f"p{i}", prompt_token_ids=rng.integers(1, vocab, 128, dtype=np.int32),
        completions=[CompletionData(rng.integers(1, vocab, tokens, dtype=np.int32),
                                    -rng.random(tokens, dtype=np.float32), 1.0, False, {"answer_correct": 1.0})
                     for _ in range(completions)], policy_version=0, sampler_id="sampler-0",
        data_position=i)
        for i in range(count)]


def _drain_stream(client, stream: str, count: int, decode) -> None:
    last, seen = "0", 0
    while seen < count:
        reply = client.xread({stream: last}, count=64, block=1000)
        for _name, entries in reply or []:
            for entry_id, fields in entries:
                decode(fields[b"g"])
                last, seen = entry_id, seen + 1


def _redis_baseline(client, name: str, groups: list, encode, decode) -> float:
    """Seconds to encode each group, XADD it (pipelined by 16) and XREAD + decode it in another thread."""
    stream = f"bench:{name}"
    client.delete(stream)
    start = time.perf_counter()
    reader = threading.Thread(target=_drain_stream, args=(client, stream, len(groups), decode))
    reader.start()
    pipe = client.pipeline(transaction=False)
    for k, group in enumerate(groups, 1):
        pipe.xadd(stream, {"g": encode(group)})
        if k % 16 == 0:
            pipe.execute()
    pipe.execute()
    reader.join()
    elapsed = time.perf_counter() - start
    client.delete(stream)
    return elapsed


def _as_json(group: GroupData) -> bytes:
    return json.dumps({"group_id": group.group_id, "prompt_id": group.prompt_id,
                       "prompt_token_ids": group.prompt_token_ids.tolist(), "policy_version": group.policy_version,
                       "sampler_id": group.sampler_id,
                       "completions": [{"token_ids": c.token_ids.tolist(), "logprobs": c.logprobs.tolist(),
                                        "reward": c.reward} for c in group.completions]}).encode()


def _from_json(payload: bytes) -> None:
    doc = json.loads(payload)
    for c in doc["completions"]:
        np.asarray(c["token_ids"], np.int32), np.asarray(c["logprobs"], np.float32)


def _ours(redis_url: str, groups: list[GroupData], tokens: int, run_name: str) -> float:
    client = connect(redis_url, 5)
    buffer = RedisStreamBuffer(client, run_name)  # a fresh run per round: the ingest accepts a group id once
    limits = GroupLimits(len(groups[0].completions), 128, tokens, 32_000)
    server = TrainerServer(IngestServicer(buffer, limits, max_groups=10**9, retry_after_ms=10), WeightPublisher(),
                           "127.0.0.1", 0)
    port = server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    sender = RolloutClient(channel, backlog_max_groups=64, max_groups_per_message=16).start()

    def consume():
        seen = 0
        while seen < len(groups):
            entries = buffer.read(64, 1000)
            for e in entries:
                decode_group(e.payload)
            buffer.settle((e.entry_id, e.group_id, "trained", 1) for e in entries)
            seen += len(entries)

    try:
        grpc.channel_ready_future(channel).result(timeout=30)  # connecting is start-up, not transport
        start = time.perf_counter()
        reader = threading.Thread(target=consume)
        reader.start()
        for g in groups:
            sender.put(to_proto(g), timeout_s=60)
        if not sender.drain(60):
            raise RuntimeError(f"ingest did not take the groups: {dict(sender.stats)}")
        reader.join()
        elapsed = time.perf_counter() - start
        if sender.stats["accepted"] != len(groups):
            raise RuntimeError(f"ingest refused groups: {dict(sender.stats)}")
    finally:
        sender.close()
        channel.close()
        server.stop(0)
    return elapsed


def run(quick: bool = False) -> dict:
    count, completions, tokens, repeats = (16, 8, 512, 1) if quick else (400, 8, 512, 5)
    groups = make_groups(count, completions, tokens)
    proto_payloads = [encode_group(g) for g in groups]
    megabytes = sum(len(p) for p in proto_payloads) / 1e6
    # always a private embedded server: the pickle baseline must only ever read back bytes this process wrote
    embedded = EmbeddedRedis().start()
    url = embedded.url
    try:
        client = connect(url, 5)
        runs = {"ours": [], "json": [], "pickle": [], "raw_redis": []}
        for k in range(repeats):  # interleaved, so a slow spell of the machine hits every contender
            runs["ours"].append(_ours(url, groups, tokens, f"bench-ours-{k}"))
            runs["json"].append(_redis_baseline(client, "json", groups, _as_json, _from_json))
            runs["pickle"].append(_redis_baseline(client, "pickle", groups, pickle.dumps, pickle.loads))
            runs["raw_redis"].append(_redis_baseline(client, "raw", proto_payloads, lambda b: b, lambda b: None))
        seconds = {k: statistics.median(v) for k, v in runs.items()}
    finally:
        embedded.stop()
    rate = {k: count / v for k, v in seconds.items()}
    return {
        "benchmark": "transport", "quick": quick, "groups": count, "completions_per_group": completions,
        "tokens_per_completion": tokens, "repeats": repeats, "protobuf_megabytes": round(megabytes, 3),
        "groups_per_second": {k: round(v, 1) for k, v in rate.items()},
        "megabytes_per_second_ours": round(megabytes / seconds["ours"], 1),
        "ratio_vs_json": round(rate["ours"] / rate["json"], 3),
        "ratio_vs_pickle": round(rate["ours"] / rate["pickle"], 3),
        "fraction_of_raw_redis": round(rate["ours"] / rate["raw_redis"], 3),
    }
