"""The sampler side of `bench weights`, as its own process: receives raw bytes, then installs published versions.

    python -m grpo_stream.bench.weights_peer SPEC_JSON

SPEC_JSON: {"arch": {...Architecture fields}, "dtype": "float32" | "bfloat16" (the model's), "raw_port": int, "raw_bytes": int, "raw_repeats": int,
"grpc": "host:port" | null, "checkpoint_dir": str | null, "versions": int, "streams": int, "data_host": str | null (TCP data plane)}.
Prints one JSON line per event: {"raw_seconds": s} per raw copy, {"ready": true} once set up, then {"version": v, "installed_unix": t,
"fetch_seconds": s} per installed version, until version `versions - 1` is installed.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def _raw(port: int, nbytes: int) -> float:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"go")
        start, got = time.perf_counter(), 0
        while got < nbytes:
            n = sock.recv_into(view[got:], min(nbytes - got, 16 << 20))
            if not n:
                raise ConnectionError(f"raw sender closed after {got} of {nbytes} bytes")
            got += n
        return time.perf_counter() - start


def main() -> int:
    spec = json.loads(sys.argv[1])
    for _ in range(spec["raw_repeats"]):
        print(json.dumps({"raw_seconds": _raw(spec["raw_port"], spec["raw_bytes"])}), flush=True)

    import grpc
    import jax
    import jax.numpy as jnp

    from grpo_stream.common.model.architectures import Architecture
    from grpo_stream.common.rpc.grpc_util import CHANNEL_OPTIONS
    from grpo_stream.common.model.policy import build_from_architecture
    from grpo_stream.common.model.sharding import make_mesh
    from grpo_stream.common.config.schema import WeightsSection
    from grpo_stream.common.weights.registry import weight_source
    from grpo_stream.common.weights.transport import SourceContext
    from grpo_stream.sampler_service.weight_sync import WeightSync

    model = build_from_architecture(Architecture(**spec["arch"]), seed=None,
                                    dtype=getattr(jnp, spec.get("dtype", "float32")))
    mesh = make_mesh(1, 1, jax.devices(), "sampler.mesh.tp")
    channel = None
    if spec.get("grpc"):
        channel = grpc.insecure_channel(spec["grpc"], options=CHANNEL_OPTIONS)
    weights = WeightsSection(transport=spec["transport"], fetch_streams=spec.get("streams", 1),
                             data_plane="tcp" if spec.get("data_host") else "grpc",
                             checkpoint_dir=spec.get("checkpoint_dir"))
    fetcher = weight_source(spec["transport"], SourceContext(weights, "bench-peer", 600, channel=channel,
                                                             trainer_host=spec.get("data_host") or ""))
    sync = WeightSync(fetcher, model, mesh, "bench-peer", retry_initial_s=0.05, retry_max_s=0.2)
    last = spec["versions"] - 1  # a sampler installs the latest version, so it may skip some in between
    print(json.dumps({"ready": True}), flush=True)
    installed = -1
    while installed < last:
        got = sync.poll()
        if got is None:
            time.sleep(0.005)
            continue
        jax.block_until_ready(got.params)
        print(json.dumps({"version": got.version, "installed_unix": time.time(),
                          "fetch_seconds": got.fetch_seconds, "fetch_bytes": got.nbytes}), flush=True)
        sync.mark_installed(got)
        installed = got.version
        del got
    if channel is not None:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
