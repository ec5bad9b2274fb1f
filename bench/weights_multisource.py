"""`bench weights`, multi-source case: a version served by a trainer of 2 JAX processes to one sampler process.

Each trainer process of a multi-process trainer serves only the slices it holds (common/weights/host_shards.py);
the sampler fetches from both in parallel and assembles its tensors. Here the trainer processes are real JAX
processes joined by jax.distributed (one device each, the model sharded fsdp=2 over them) running the trainer's
own publication path (GrpcSink on arrays no process holds whole, TrainerServer with the TCP data plane, process
0's manifest naming both hosts); the baseline in the same run is the same harness with one trainer process
holding the whole model. The sampler is bench/weights_peer.py. Reported per case: publish-to-installed seconds
and MB/s (medians), and the ratio of the two.

    python -m grpo_stream.bench.weights_multisource serve SPEC_JSON   # one trainer process (used by run())
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from grpo_stream.common.rollouts.redis_server import free_port
from grpo_stream.trainer_service.control_messages import SECRET_ENV, new_secret


def _serve(spec: dict) -> int:
    """One trainer process: publish each version number read from stdin; print one JSON line per event."""
    import jax  # noqa: PLC0415 - after the environment is set

    from grpo_stream.common.config.schema import WeightsSection  # noqa: PLC0415
    from grpo_stream.common.model.architectures import Architecture  # noqa: PLC0415
    from grpo_stream.common.model.policy import build_from_architecture  # noqa: PLC0415
    from grpo_stream.common.model.sharding import initialize_distributed, make_mesh, place  # noqa: PLC0415
    from grpo_stream.common.weights.registry import weight_sink  # noqa: PLC0415
    from grpo_stream.common.weights.transport import SinkContext  # noqa: PLC0415
    from grpo_stream.trainer_service.multihost import join_group  # noqa: PLC0415
    from grpo_stream.trainer_service.publication.publisher import WeightPublisher  # noqa: PLC0415
    from grpo_stream.trainer_service.server import TrainerServer  # noqa: PLC0415

    n = spec["processes"]
    if n > 1:
        initialize_distributed("always")
    model = build_from_architecture(Architecture(**spec["arch"]), seed=0)
    mesh = make_mesh(n, 1, jax.devices(), "bench")
    named = model.named_arrays(place(model.params, mesh))
    publisher = WeightPublisher(weight_sink("grpc", SinkContext(WeightsSection())), "grpc", epoch="bench")
    server = TrainerServer(None, publisher, "127.0.0.1", 0, data_port=0)
    port = server.start()
    if n > 1:
        from jax._src.distributed import global_state  # noqa: PLC0415

        join_group(n, jax.process_index(), global_state.client).serve_versions(publisher, port, server.data.port)
    print(json.dumps({"port": port, "data_port": server.data.port}), flush=True)
    for line in sys.stdin:
        stats = publisher.publish_arrays(int(line), named)
        print(json.dumps({"published": stats.version, "seconds": stats.seconds}), flush=True)
    server.stop(0)
    sys.stdout.flush()
    # no distributed shutdown: the harness stops process 1 before process 0 (whose coordination service the other
    # polls), and JAX's at-exit shutdown would wait for a barrier the other process no longer joins
    os._exit(0)


def _event(proc: subprocess.Popen) -> dict:
    """The next JSON line of a trainer process (Gloo prints its connection lines on stdout too)."""
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench trainer process exited with code {proc.wait()}")
        if line.startswith("{"):
            return json.loads(line)


def _case(arch: dict, processes: int, repeats: int) -> dict:
    coordinator = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "GRPO_STREAM_ADVERTISE_HOST": "127.0.0.1",
           SECRET_ENV: new_secret()}  # the processes' announcements are sealed with it, as a trainer's are
    trainers = [subprocess.Popen(
        [sys.executable, "-m", "grpo_stream.bench.weights_multisource", "serve",
         json.dumps({"arch": arch, "processes": processes})], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**env, "JAX_COORDINATOR_ADDRESS": coordinator, "JAX_NUM_PROCESSES": str(processes),
             "JAX_PROCESS_ID": str(k)} if processes > 1 else env) for k in range(processes)]
    peer = None
    try:
        ports = [_event(t) for t in trainers]
        from grpo_stream.bench.weights import _Peer  # noqa: PLC0415

        peer = _Peer({"arch": arch, "dtype": "float32", "raw_port": 0, "raw_bytes": 0, "raw_repeats": 0,
                      "transport": "grpc", "grpc": f"127.0.0.1:{ports[0]['port']}", "checkpoint_dir": None,
                      "versions": repeats + 1, "streams": 2, "data_host": "127.0.0.1"})
        assert peer.next() == {"ready": True}
        totals, nbytes = [], 0
        for version in range(repeats + 1):  # version 0 warms up (first install allocates), not counted
            start = time.time()
            for t in trainers[::-1]:  # process 0 last: its manifest waits for the others anyway
                t.stdin.write(f"{version}\n")
                t.stdin.flush()
            for t in trainers:
                assert _event(t)["published"] == version
            event = peer.next()
            assert event["version"] == version, event
            nbytes = event["fetch_bytes"]
            if version > 0:
                totals.append(event["installed_unix"] - start)
    finally:
        if peer is not None:
            peer.close()
        for t in trainers[::-1]:  # process 0 last: it hosts the coordination service
            t.stdin.close()
            try:
                t.wait(timeout=30)
            except subprocess.TimeoutExpired:
                t.kill()
    seconds = statistics.median(totals)
    return {"trainer_processes": processes, "bytes": nbytes, "publish_to_installed_s": round(seconds, 3),
            "mb_per_s": round(nbytes / seconds / 1e6, 1)}


def run(arch: dict, repeats: int) -> dict:
    """Both cases on the same model, and the multi-source throughput as a share of the single-process one."""
    single, multi = _case(arch, 1, repeats), _case(arch, 2, repeats)
    return {"single_process": single, "two_processes": multi,
            "two_processes_over_single": round(multi["mb_per_s"] / single["mb_per_s"], 3)}


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: python -m grpo_stream.bench.weights_multisource serve SPEC_JSON")
    sys.exit(_serve(json.loads(sys.argv[2])))
