"""Benchmark: publishing weights of a ~100M-parameter model until a sampler process has them installed.

Ours, per case: from the trainer's `publish_arrays` call to the moment a sampler in another process has the
version installed on its device (fetched slices, checksummed, placed), as wire bytes per second. Cases: the grpc
transport with its TCP data plane and with gRPC streams only, each for a float32 model and a bfloat16 model
(weights in bfloat16 end to end, as Llama/Qwen post-training publishes them), plus a float32 model sent as
bfloat16 (`weights.wire_dtype: bfloat16`: cast on both sides); the checkpoint transport for the float32 model. Baseline in the same run: a raw loopback TCP copy
of the same number of bytes into a preallocated buffer in the same peer process (the ceiling of moving
bytes between two processes here). Medians of `repeats`.

Trainer stall: the real RL update (PolicyUpdater) on the same model, stepping with a publication after
every step on the publication thread (as the trainer does) while the peer fetches each version. The
stall is the time the step loop itself spends handing a publication off (waiting for the previous one
to finish + submitting), as a share of the step time measured without publishing. The step-time
slowdown is reported too: on a 2-core machine the peer and the serving threads compete with XLA for
cores, which is not a stall of the loop but is what a user would see.

Staging: the grpc sink's host copy of one version of the float32 model on this backend, by how it is taken
(common/weights/host_staging.py): `device_get` (fresh host arrays per version, the sink's path before reused
buffers; on CPU views of the device buffers, no copy), `pooled` (asynchronous copies gathered into two sets of host
buffers taken in turn) and, where the devices offer pinned host memory, `pooled_pinned`; `default` names the one
the sink takes here.

Multi-source (bench/weights_multisource.py): a trainer of 2 JAX processes, each serving only its own shards, to
one sampler process, against the same harness with 1 trainer process (`multi_source_over_single`).
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from grpo_stream.common.model.architectures import Architecture
from grpo_stream.common.config.learning import AlgoSection, LoraSection
from grpo_stream.common.config.schema import WeightsSection
from grpo_stream.common.rpc.grpc_util import SERVER_OPTIONS
from grpo_stream.common.model.lora import apply_lora
from grpo_stream.common.model.policy import build_from_architecture
from grpo_stream.common.weights.host_staging import HostStaging, offers_pinned
from grpo_stream.common.registry.transports import transport_spec
from grpo_stream.common.weights.registry import weight_sink
from grpo_stream.common.weights.transport import SinkContext
from grpo_stream.protos import weights_pb2_grpc
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.publication.publisher import WeightPublisher
from grpo_stream.trainer_service.learning.packing import one_sequence_per_row
from grpo_stream.trainer_service.learning.rl_update import PolicyUpdater
from grpo_stream.trainer_service.publication.grpc_transport_server.data_plane import WeightDataServer
from grpo_stream.trainer_service.publication.weight_service import WeightService
from grpo_stream.bench import weights_multisource

FULL = dict(vocab_size=32_000, num_layers=8, embed_dim=768, hidden_dim=2048, num_heads=12, num_kv_heads=4,
            head_dim=64)
QUICK = dict(vocab_size=4000, num_layers=2, embed_dim=256, hidden_dim=512, num_heads=4, num_kv_heads=2, head_dim=64)


class _Peer:
    """The sampler process; yields its JSON lines."""

    def __init__(self, spec: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "grpo_stream.bench.weights_peer", json.dumps(spec)],
                                     stdout=subprocess.PIPE, text=True)

    def next(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench peer exited with code {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _raw_sender(listener: socket.socket, payload: list[memoryview], repeats: int) -> None:
    for _ in range(repeats):
        conn, _ = listener.accept()
        with conn:
            conn.recv(2)
            for view in payload:
                conn.sendall(view)


def _serve(publisher: WeightPublisher) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=SERVER_OPTIONS)
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightService(publisher), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def _case(named: dict, arch: dict, transport: str, dtype: str, repeats: int, raw_repeats: int,
          streams: int, data_plane: str = "grpc", lora=None) -> dict:
    """`named`: the model's arrays (their dtype is the model's); `dtype`: weights.wire_dtype. With `lora` (a
    LoraPolicy), `named` are its adapters: the base is published once first, and each version carries `named`."""
    model_dtype = jnp.dtype(next(iter(named.values())).dtype).name
    tmp = tempfile.TemporaryDirectory(prefix="bench-weights-")
    weights = WeightsSection(transport=transport, checkpoint_dir=tmp.name, keep_versions=2)
    publisher = WeightPublisher(weight_sink(transport, SinkContext(weights)), transport, wire_dtype=dtype)
    server, port = _serve(publisher)
    data = WeightDataServer(publisher, "127.0.0.1", 0) if data_plane == "tcp" else None
    if data is not None:
        data.start()
    wire = jnp.dtype(dtype if dtype != "model" else model_dtype)
    nbytes = sum(int(np.prod(a.shape)) * wire.itemsize for a in named.values())
    host = [np.asarray(a.astype(wire)) for a in named.values()]
    payload = [memoryview(a.reshape(-1).view(np.uint8)) for a in host]
    listener = socket.create_server(("127.0.0.1", 0))
    sender = threading.Thread(target=_raw_sender, args=(listener, payload, raw_repeats), daemon=True)
    sender.start()
    peer = _Peer({"arch": arch, "dtype": model_dtype, "raw_port": listener.getsockname()[1], "raw_bytes": nbytes,
                  "raw_repeats": raw_repeats, "transport": transport,
                  "grpc": f"127.0.0.1:{port}" if transport_spec(transport).trainer_serves else None,
                  "checkpoint_dir": tmp.name, "versions": repeats + 1, "streams": streams,
                  "data_host": "127.0.0.1" if data is not None else None})
    try:
        raw = [peer.next()["raw_seconds"] for _ in range(raw_repeats)]
        del host, payload
        assert peer.next() == {"ready": True}
        if lora is not None:
            publisher.publish_base(lora.split_named(lora.adapted.params)[0])
        totals, publish, fetch, fetched = [], [], [], []
        for version in range(repeats + 1):  # version 0 warms up (first install allocates), not counted
            start = time.time()
            stats = publisher.publish_arrays(version, named, adapters=None if lora is None else lora.adapter_version())
            event = peer.next()
            fetched.append(event["fetch_bytes"])
            assert event["version"] == version, event
            if version > 0:
                totals.append(event["installed_unix"] - start)
                publish.append(stats.seconds)
                fetch.append(event["fetch_seconds"])
    finally:
        peer.close()
        server.stop(0)
        if data is not None:
            data.stop()
        listener.close()
        tmp.cleanup()
    ours, raw_s = statistics.median(totals), statistics.median(raw) if raw else None
    out = {"transport": transport, "data_plane": data_plane if transport == "grpc" else None,
           "lora_rank": None if lora is None else lora.rank,
           "model_dtype": model_dtype, "wire_dtype": wire.name, "bytes": nbytes,
           "publish_to_installed_s": round(ours, 3), "publish_call_s": round(statistics.median(publish), 3),
           "sampler_fetch_s": round(statistics.median(fetch), 3),
           "mb_per_s": round(nbytes / ours / 1e6, 1), "sampler_fetch_bytes": fetched}
    if raw_s:
        out.update(raw_copy_s=round(raw_s, 4), raw_mb_per_s=round(nbytes / raw_s / 1e6, 1),
                   fraction_of_raw=round(raw_s / ours, 3))
    return out


def _stall(model, arch: dict, steps: int, rows: int, length: int) -> dict:
    rng = np.random.default_rng(0)
    # whole rows: a one-token prompt, then a completion to the end of the row, each sequence alone in its row
    batch = TrainBatch(tokens=rng.integers(1, arch["vocab_size"], (rows, length)).astype(np.int32),
                       valid=np.ones((rows, length), bool), loss_mask=np.ones((rows, length - 1), np.float32),
                       behaviour_logprobs=np.full((rows, length - 1), -5.0, np.float32),
                       advantages=rng.standard_normal(rows).astype(np.float32), fresh=np.zeros((rows,), np.float32))
    updater = PolicyUpdater(model, model.params, AlgoSection(), 1e-6, 1.0, 1.0, 0,
                            one_sequence_per_row(1, length, rows, rows))
    updater.update(batch)  # compile
    plain = []
    for _ in range(steps):
        t = time.perf_counter()
        updater.update(batch)
        plain.append(time.perf_counter() - t)
    publisher = WeightPublisher()
    server, port = _serve(publisher)
    data = WeightDataServer(publisher, "127.0.0.1", 0)  # the default path: slices over the TCP data plane
    data.start()
    peer = _Peer({"arch": arch, "dtype": "float32", "raw_port": 0, "raw_bytes": 0, "raw_repeats": 0,
                  "transport": publisher.transport, "grpc": f"127.0.0.1:{port}", "checkpoint_dir": None, "versions": steps, "streams": 2,
                  "data_host": "127.0.0.1"})
    assert peer.next() == {"ready": True}
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    pending, with_publish, stalls = None, [], []
    try:
        for version in range(steps):
            t = time.perf_counter()
            updater.update(batch)
            t_compute = time.perf_counter()
            if pending is not None:  # what the trainer loop does after each step
                pending.result()
            pending = worker.submit(publisher.publish_arrays, version, model.named_arrays(updater.params))
            t_end = time.perf_counter()
            stalls.append(t_end - t_compute)
            with_publish.append(t_end - t)
        pending.result()
        installed = [peer.next()["version"]]
        while installed[-1] < steps - 1:
            installed.append(peer.next()["version"])
    finally:
        peer.close()
        server.stop(0)
        data.stop()
        worker.shutdown()
    step = statistics.median(plain)
    return {"rows": rows, "tokens_per_row": length, "step_s": round(step, 3),
            "step_with_publish_s": round(statistics.median(with_publish), 3),
            "stall_per_publish_s": round(statistics.median(stalls), 4),
            "stall_share_of_step": round(statistics.median(stalls) / step, 4),
            "step_slowdown": round(statistics.median(with_publish) / step, 3), "versions_installed": installed}


def _staging(named: dict, repeats: int) -> dict:
    """Median seconds of the sink's host copy per mode, over `repeats` versions after a first that allocates."""
    first = next(iter(named.values()))
    accelerator = next(iter(first.devices())).platform != "cpu"
    modes = {"device_get": HostStaging(pooled=False), "pooled": HostStaging(pooled=True, pinned=False)}
    if offers_pinned(first):
        modes["pooled_pinned"] = HostStaging(pooled=True, pinned=True)
    out = {"default": ("pooled_pinned" if offers_pinned(first) else "pooled") if accelerator else "device_get"}
    for mode, staging in modes.items():
        held, times = [], []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            held = [staging.to_host(named)] + held[:1]  # the served version and the one before stay referenced
            times.append(time.perf_counter() - start)
        out[f"{mode}_s"] = round(statistics.median(times[1:]), 4)
    return out


def run(quick: bool = False) -> dict:
    shape = QUICK if quick else FULL
    arch = dict(family="qwen3", norm_eps=1e-6, rope_theta=1_000_000, tied_embeddings=False, **shape)
    model = build_from_architecture(Architecture(**arch), seed=0)
    f32 = model.named_arrays()
    bf16 = {n: a.astype(jnp.bfloat16) for n, a in f32.items()}
    repeats = 2 if quick else 3
    # (model arrays, wire dtype): float32 model; bfloat16 model; float32 model cast to bfloat16 on the wire
    kinds = {"float32": (f32, "model"), "bfloat16": (bf16, "model"), "float32_as_bfloat16": (f32, "bfloat16")}
    cases = {(plane, kind): _case(arrays, arch, "grpc", wire, repeats, repeats, 2, plane)
             for plane in ("tcp", "grpc") for kind, (arrays, wire) in kinds.items()}
    cases[("checkpoint", "float32")] = _case(f32, arch, "checkpoint", "model", repeats, 0, 2)
    # model.lora (rank 16 on every projection): the base goes once, each version carries the adapters alone
    lora = apply_lora(model, model.params, LoraSection(rank=16), seed=0)
    adapters = lora.split_named(lora.adapted.params)[1]
    cases[("tcp", "float32_lora_r16")] = _case(adapters, arch, "grpc", "model", repeats, 0, 2, "tcp", lora=lora)
    del bf16
    staging = _staging(f32, repeats + 2)
    stall = _stall(model, arch, steps=2 if quick else 4, rows=2, length=32 if quick else 64)
    # a trainer of 2 JAX processes, each serving its own shards, to one sampler; against 1 process, same harness
    multi = weights_multisource.run(arch, repeats)
    lora_case = cases[("tcp", "float32_lora_r16")]
    full_bytes = cases[("tcp", "float32")]["bytes"]
    out = {"benchmark": "weights", "quick": quick, "params": model.num_params(),
           # bytes of each LoRA version after the first against the whole float32 model's (issue 22: <= 0.05)
           "lora_version_fraction": round(max(lora_case["sampler_fetch_bytes"][1:]) / full_bytes, 4),
           "lora_first_install_bytes": lora_case["sampler_fetch_bytes"][0],
           "devices": [str(d) for d in jax.devices()], "cases": list(cases.values()), "staging": staging,
           "stall": stall,
           "stall_share_of_step": stall["stall_share_of_step"], "multi_source": multi,
           "multi_source_over_single": multi["two_processes_over_single"]}
    # the default path (weights.transport=grpc, data_plane=tcp) against the raw copy; then gRPC streams only
    short = {"float32": "f32", "bfloat16": "bf16"}  # the two with targets (bench/runner.py)
    for (plane, kind), case in cases.items():
        if "fraction_of_raw" not in case:  # LoRA's adapters: no raw copy of the whole model to compare with
            continue
        if plane == "tcp":
            out[f"fraction_of_raw_{short.get(kind, kind)}"] = case["fraction_of_raw"]
        elif plane == "grpc":
            out[f"fraction_of_raw_grpc_stream_{kind}"] = case["fraction_of_raw"]
    return out
