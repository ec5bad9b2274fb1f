"""`grpo-stream devices --config C [--gpus N] [--gpu-memory-gib G] [--compose] [--json F] [k=v ...]`: the GPUs and
memory settings each process of the run gets (grpo_stream/plan/device_plan.py), as `up` would give them on this host
or on a host of N GPUs; `--compose` prints them as compose/.env lines for compose/docker-compose.yml."""

from __future__ import annotations

import json
import os
import pathlib

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.registry.transports import transport_spec
from grpo_stream.plan.device_plan import (PREALLOCATE, DeviceLayoutError, DevicePlan, detect_gpus,
                                                    load_figures, plan_devices)

COMPOSE_SAMPLERS = 3  # sampler-0 .. sampler-2 in compose/docker-compose.yml
JAX_DEFAULT_FRACTION = "0.75"  # JAX's own XLA_PYTHON_CLIENT_MEM_FRACTION, for a process with a GPU to itself


def compose_env(cfg: RunConfig, plan: DevicePlan) -> dict[str, str]:
    """compose/.env settings that give each compose service what `plan` gives the process of the same name.

    Each GPU service reserves every GPU and sees only its own through CUDA_VISIBLE_DEVICES (the same mechanism as
    `up`), so no device id is named that a host may lack. A sampler's memory fraction is its JAX cap, or for vLLM
    its gpu_memory_utilization (the compose command passes it)."""
    if transport_spec(cfg.weights.transport).in_process:  # `up` runs one `colocated` process; compose has none
        raise DeviceLayoutError(f"weights.transport={cfg.weights.transport}: the trainer and the samplers are one "
                                "process (`grpo-stream colocated`), which compose does not run; use `up`, or "
                                "weights.transport=grpc for compose's trainer and sampler containers")
    if cfg.trainer.processes > 1:
        raise DeviceLayoutError("trainer.processes > 1: compose runs one trainer container; use `up` or the "
                                "Kubernetes files (compose/k8s) for a multi-process trainer")
    if cfg.sampler.replicas > COMPOSE_SAMPLERS:
        raise DeviceLayoutError(f"sampler.replicas={cfg.sampler.replicas}: compose/docker-compose.yml has "
                                f"{COMPOSE_SAMPLERS} sampler services; copy sampler-2 for more")
    if not plan.gpu_ids:
        raise DeviceLayoutError("no GPU to lay out: give --gpus N (the GPU host's count)")
    env = {"SAMPLER_ENGINE": cfg.sampler.engine, "SAMPLER_REPLICAS": str(cfg.sampler.replicas),
           "COMPOSE_PROFILES": ",".join(f"sampler-{i}" for i in range(1, cfg.sampler.replicas))}
    for p in plan.processes:
        key = "TRAINER" if p.role == "trainer" else f"SAMPLER{p.name.split('-')[1]}"
        env[f"{key}_GPUS"] = ",".join(plan.gpu_ids[g] for g in p.gpus)
        if not p.jax_on_gpu:
            env[f"{key}_GPU_PREALLOCATE"] = "false"  # its JAX is on the CPU: nothing to preallocate
            env[f"{key}_GPU_MEM_FRACTION"] = str(p.share if p.share is not None
                                                 else cfg.sampler.vllm.gpu_memory_utilization)
        else:
            env[f"{key}_GPU_PREALLOCATE"] = p.env.get(PREALLOCATE, "true")
            env[f"{key}_GPU_MEM_FRACTION"] = f"{p.share:.3f}" if p.share is not None else JAX_DEFAULT_FRACTION
        if p.role == "sampler":
            env[f"{key}_OVERRIDES"] = " ".join(o for o in p.overrides if "gpu_memory_utilization" not in o)
    return env


def run_devices(cfg: RunConfig, gpus: int | None, memory_gib: float | None, compose: bool,
                json_path: pathlib.Path | None) -> int:
    """Print the plan (or compose's settings); exit 0, or 2 with the refusal's reason when it cannot work."""
    try:
        if gpus is None:
            ids, memory = detect_gpus(cfg, os.environ)
        else:
            ids, memory = [str(g) for g in range(gpus)], None
        memory = int(memory_gib * (1 << 30)) if memory_gib else memory
        plan = plan_devices(cfg, ids, memory, load_figures(cfg))
        env = compose_env(cfg, plan) if compose else None
    except DeviceLayoutError as exc:
        print(f"grpo-stream devices: error: {exc}")
        return 2
    if env is not None:
        print("# compose/.env settings for this layout (grpo-stream devices --compose)")
        print("\n".join(f"{k}={v}" for k, v in env.items()))
    else:
        print("\n".join(plan.lines()))
    if json_path is not None:
        doc = plan.to_json() | ({"compose_env": env} if env is not None else {})
        json_path.parent.mkdir(parents=True, exist_ok=True)  # as `plan --json` makes its folder
        json_path.write_text(json.dumps(doc, indent=1))
    return 0

