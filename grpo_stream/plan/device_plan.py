"""Which GPUs each process of a run gets and how processes that share a GPU split its memory: one pure function of
the config and the GPUs a host shows (`plan_devices`), used by `up` (each child's environment and overrides), by
`grpo-stream devices` (the same plan as compose's variables) and, for what a process can decide alone, by the
processes themselves (`own_process_env`: a vLLM sampler's own JAX stays on the CPU).

Layout, when the config names no GPUs (hardware.trainer_devices / sampler_devices): the trainer takes the first
fsdp x tp GPUs, process k of trainer.processes its k-th share; each sampler a group of its tp GPUs after them, one
group each while there are enough, round-robin over the groups there are when there are too few; with no GPU left
after the trainer, the samplers share the trainer's.

Memory, on a GPU that several processes share: JAX's default takes 75% of every GPU it sees at start, leaving a second
process nothing (out-of-memory or cuBLAS failures at start). So a JAX process there allocates on demand
(XLA_PYTHON_CLIENT_PREALLOCATE=false) under a cap, XLA_PYTHON_CLIENT_MEM_FRACTION = its share; a vLLM sampler gets
its share as sampler.vllm.gpu_memory_utilization (vLLM's limit for its own instance) and, with plan figures, a KV
cache sized to its slots (sampler.vllm.kv_cache_gib). Shares split (1 - hardware.margin) of the GPU by need: plan's
per-device totals (hardware.plan_json), or a vLLM sampler's gpu_memory_utilization when the config sets it; processes
of unknown need split what is left, the trainer counting twice a sampler (it holds gradients and optimizer state).
Known needs that pass the budget are refused with the fixes named.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import subprocess
from typing import Mapping, Sequence

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.config.serving import engine_context
from grpo_stream.common.registry.engines import engine_spec
from grpo_stream.common.registry.transports import transport_spec

GIB = 1 << 30
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
VLLM_HEADROOM = 1.25  # a vLLM sampler's weights + KV cache, times this for activations, CUDA graphs and the runtime
MIN_SHARE = 0.05  # below this part of a GPU a process of unknown need is refused rather than started to fail
TRAINER_WEIGHT = 2.0  # a trainer's share of a shared GPU against a sampler's, when plan gives no figures


class DeviceLayoutError(ValueError):
    """A layout that cannot work on these GPUs; the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class ProcessPlan:
    """One process's GPUs (indices into the host's laid-out GPUs), its memory share and what it is given."""

    name: str                      # trainer, trainer-<k>, sampler-<i>, colocated
    role: str                      # trainer | sampler | colocated
    engine: str                    # the sampler.engine it runs (the trainer: jax)
    gpus: tuple[int, ...]
    jax_on_gpu: bool = True        # its own JAX uses the GPUs; else an engine that manages them itself (vLLM)
    share: float | None = None     # fraction of each of its GPUs it may use; None: the runtime's own default
    need_bytes: int | None = None  # per GPU, from plan's figures, when known
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    gpu_ids: tuple[str, ...]       # the host's ids of the GPUs laid out (what CUDA_VISIBLE_DEVICES names)
    gpu_memory_bytes: int | None
    processes: tuple[ProcessPlan, ...]

    def process(self, name: str) -> ProcessPlan:
        return next(p for p in self.processes if p.name == name)

    def sharing(self) -> dict[int, list[str]]:
        """GPU index -> the processes on it, for the GPUs more than one process uses."""
        users: dict[int, list[str]] = {}
        for p in self.processes:
            for g in p.gpus:
                users.setdefault(g, []).append(p.name)
        return {g: names for g, names in sorted(users.items()) if len(names) > 1}

    def lines(self) -> list[str]:
        """What `up` and `grpo-stream devices` print: one line per process."""
        if not self.gpu_ids:
            return ["devices: no GPU (CPU run)"]
        memory = f", {self.gpu_memory_bytes / GIB:.1f} GiB each" if self.gpu_memory_bytes else ""
        out = [f"devices: {len(self.gpu_ids)} GPU(s) {','.join(self.gpu_ids)}{memory}"]
        for p in self.processes:
            share = f", {p.share:.0%} of each" if p.share is not None else ", the GPU to itself"
            need = f" (plan: {p.need_bytes / GIB:.2f} GiB)" if p.need_bytes else ""
            out.append(f"  {p.name:<10} {p.engine:<4} GPU {','.join(self.gpu_ids[g] for g in p.gpus)}{share}{need}"
                       + (f"; {' '.join(p.overrides)}" if p.overrides else ""))
        return out

    def to_json(self) -> dict:
        return {"gpu_ids": list(self.gpu_ids), "gpu_memory_bytes": self.gpu_memory_bytes,
                "sharing": {str(g): n for g, n in self.sharing().items()},
                "processes": [dataclasses.asdict(p) | {"gpus": [self.gpu_ids[g] for g in p.gpus]}
                              for p in self.processes]}


def host_devices_needed(cfg: RunConfig) -> tuple[int, int]:
    """(trainer process, sampler process) device counts the configured meshes need.

    With weights.transport=local the first number is for the single process holding the trainer and samplers.
    """
    trainer = cfg.trainer.mesh.fsdp * cfg.trainer.mesh.tp
    tp, w = sampler_gpus_needed(cfg), cfg.weights
    if not transport_spec(w.transport).in_process:
        return trainer, tp
    if w.trainer_devices_fraction == 1.0 and w.sampler_devices_fraction == 1.0:
        return max(trainer, tp), tp
    for n in range(2, 1 << 16):
        if (round(n * w.trainer_devices_fraction) >= trainer and round(n * w.sampler_devices_fraction)
                >= cfg.sampler.replicas * tp and round(n * w.trainer_devices_fraction)
                + round(n * w.sampler_devices_fraction) <= n):
            return n, tp
    raise ValueError("weights.*_devices_fraction: no device count fits the trainer and sampler meshes")


def sampler_gpus_needed(cfg: RunConfig) -> int:
    """GPUs one sampler uses: its JAX mesh's tp, or vLLM's tensor_parallel_size."""
    return cfg.sampler.mesh.tp if engine_spec(cfg.sampler.engine).jax_mesh else cfg.sampler.vllm.tensor_parallel_size


def plan_devices(cfg: RunConfig, gpu_ids: Sequence[str], gpu_memory_bytes: int | None = None,
                 figures: dict | None = None) -> DevicePlan:
    """The run's processes on these GPUs (`gpu_ids`: the host's ids, e.g. CUDA_VISIBLE_DEVICES entries; none: a CPU
    run), their memory shares and environments. `figures`: `grpo-stream plan --json`'s document for this config.
    Raises DeviceLayoutError for a layout that cannot work."""
    gpu_ids = tuple(gpu_ids)
    procs = _layout(cfg, len(gpu_ids))
    if gpu_ids:
        procs = _with_shares(cfg, procs, gpu_memory_bytes, figures, len(gpu_ids))
    procs = [_with_env(cfg, p, gpu_ids, _shared(p, procs), figures) for p in procs]
    return DevicePlan(gpu_ids, gpu_memory_bytes, tuple(procs))


def _layout(cfg: RunConfig, n: int) -> list[ProcessPlan]:
    """Every process with its GPU indices (empty on a CPU run)."""
    engine = cfg.sampler.engine
    if transport_spec(cfg.weights.transport).in_process:  # one process holds the trainer and the samplers
        need = host_devices_needed(cfg)[0]
        gpus = _first(need, n, "the trainer and samplers of weights.transport=local", "trainer.mesh / sampler.mesh")
        return [ProcessPlan("colocated", "colocated", "jax", gpus)]
    trainer = _trainer_gpus(cfg, n)
    per = len(trainer) // cfg.trainer.processes if n else 0
    procs = [ProcessPlan("trainer" if k == 0 else f"trainer-{k}", "trainer", "jax",
                         tuple(trainer[k * per:(k + 1) * per])) for k in range(cfg.trainer.processes)]
    jax_mesh = engine_spec(engine).jax_mesh
    return procs + [ProcessPlan(f"sampler-{i}", "sampler", engine, g, jax_mesh)
                    for i, g in enumerate(_sampler_gpus(cfg, n, trainer))]


def _first(count: int, n: int, who: str, fix_field: str) -> tuple[int, ...]:
    if n == 0:
        return ()
    if count > n:
        raise DeviceLayoutError(f"{fix_field}: {who} need {count} GPUs but this host shows {n} (nvidia-smi, "
                                f"CUDA_VISIBLE_DEVICES or hardware.gpus); make the mesh smaller or use a host "
                                f"with {count}")
    return tuple(range(count))


def _trainer_gpus(cfg: RunConfig, n: int) -> tuple[int, ...]:
    need = cfg.trainer.mesh.fsdp * cfg.trainer.mesh.tp
    given = cfg.hardware.trainer_devices
    if given is None or n == 0:
        return _first(need, n, "the trainer's", "trainer.mesh (fsdp x tp)")
    if len(given) != need:
        raise DeviceLayoutError(f"hardware.trainer_devices={given}: trainer.mesh fsdp x tp needs {need} GPUs; list "
                                f"{need}, or set it to null for the first {need}")
    _check_ids(given, n, "hardware.trainer_devices")
    return tuple(given)


def _sampler_gpus(cfg: RunConfig, n: int, trainer: tuple[int, ...]) -> list[tuple[int, ...]]:
    replicas, need = cfg.sampler.replicas, sampler_gpus_needed(cfg)
    field = "sampler.mesh.tp" if engine_spec(cfg.sampler.engine).jax_mesh else "sampler.vllm.tensor_parallel_size"
    given = cfg.hardware.sampler_devices
    if n == 0:
        return [()] * replicas
    if given is not None:
        if len(given) != replicas:
            raise DeviceLayoutError(f"hardware.sampler_devices has {len(given)} lists for sampler.replicas="
                                    f"{replicas}: give one list of GPU indices per sampler, or null")
        for i, ids in enumerate(given):
            if len(ids) != need:
                raise DeviceLayoutError(f"hardware.sampler_devices[{i}]={ids}: {field}={need} needs {need} GPUs "
                                        "per sampler")
            _check_ids(ids, n, f"hardware.sampler_devices[{i}]")
        return [tuple(ids) for ids in given]
    if need > n:
        raise DeviceLayoutError(f"{field}={need}: a sampler needs {need} GPUs but this host shows {n}; lower it")
    free = [g for g in range(n) if g not in trainer]
    groups = [tuple(free[j:j + need]) for j in range(0, len(free) - need + 1, need)]
    groups = groups or [tuple(range(j, j + need)) for j in range(0, n - need + 1, need)]  # beside the trainer
    return [groups[i % len(groups)] for i in range(replicas)]


def _check_ids(ids: Sequence[int], n: int, field: str) -> None:
    beyond = [i for i in ids if i >= n]
    if beyond:
        raise DeviceLayoutError(f"{field}: GPU {beyond} beyond the {n} this host shows (indices 0..{n - 1}, counted "
                                "after CUDA_VISIBLE_DEVICES); pick from those")


def _shared(p: ProcessPlan, procs: Sequence[ProcessPlan]) -> bool:
    return any(q is not p and set(q.gpus) & set(p.gpus) for q in procs)


def _with_shares(cfg: RunConfig, procs: list[ProcessPlan], memory: int | None, figures: dict | None,
                 n: int) -> list[ProcessPlan]:
    """Each process that shares a GPU with its share of that GPU (the smallest over its GPUs)."""
    needs = {p.name: _need_bytes(cfg, p, figures) for p in procs}
    known = {p.name: _known_share(cfg, p, needs[p.name], memory) for p in procs}
    budget = 1.0 - cfg.hardware.margin
    shares: dict[str, float] = {}
    for g in range(n):
        users = [p for p in procs if g in p.gpus]
        if len(users) < 2 and not cfg.hardware.shared_devices:
            continue
        for name, share in _split(g, users, known, budget).items():
            shares[name] = min(share, shares.get(name, 1.0))
    return [dataclasses.replace(p, share=round(shares[p.name], 3) if p.name in shares else None,
                                need_bytes=needs[p.name]) for p in procs]


def _split(g: int, users: list[ProcessPlan], known: dict[str, float | None], budget: float) -> dict[str, float]:
    """Shares of GPU `g`'s budget: known needs first (scaled up to fill the GPU when every need is known), the rest
    split by weight."""
    fixed = {p.name: known[p.name] for p in users if known[p.name] is not None}
    taken = sum(fixed.values())
    if taken > budget:
        parts = ", ".join(f"{k} {v:.0%}" for k, v in fixed.items())
        raise DeviceLayoutError(f"GPU {g}: {parts} of its memory is more than the {budget:.0%} usable "
                                "(hardware.margin); give the processes their own GPUs (hardware.sampler_devices, "
                                "hardware.trainer_devices), shrink them as `grpo-stream plan` suggests, or lower "
                                "sampler.vllm.gpu_memory_utilization / kv_cache_gib")
    rest = [p for p in users if p.name not in fixed]
    if not rest:
        return {k: v * budget / taken for k, v in fixed.items()} if taken else {}
    left = budget - taken
    if left < MIN_SHARE * len(rest):
        raise DeviceLayoutError(f"GPU {g}: {', '.join(p.name for p in rest)} would get nothing: the others take "
                                f"{taken:.0%}; give them their own GPUs (hardware.sampler_devices) or lower the "
                                "others' shares")
    weight = {p.name: TRAINER_WEIGHT if p.role != "sampler" else 1.0 for p in rest}
    total = sum(weight.values())
    return {**fixed, **{k: left * w / total for k, w in weight.items()}}


def _need_bytes(cfg: RunConfig, p: ProcessPlan, figures: dict | None) -> int | None:
    """Bytes per GPU that plan's figures give this process (a vLLM sampler: weights and KV cache, with headroom)."""
    if not figures:
        return None
    if p.role in ("trainer", "colocated"):
        return int(figures["trainer"]["per_device_bytes"]["total"])
    if p.jax_on_gpu:
        return int(figures["sampler"]["per_device_bytes"]["total"]) if "sampler" in figures else None
    weights = figures["trainer"]["parameters"] * (2 if cfg.sampler_dtype() == "bfloat16" else 4) / len(p.gpus)
    return int(VLLM_HEADROOM * (weights + vllm_kv_bytes(cfg, figures["architecture"], len(p.gpus))))


def _known_share(cfg: RunConfig, p: ProcessPlan, need: int | None, memory: int | None) -> float | None:
    if not p.jax_on_gpu and "gpu_memory_utilization" in cfg.sampler.vllm.model_fields_set:
        return cfg.sampler.vllm.gpu_memory_utilization  # the user's choice
    return need / memory if need is not None and memory else None


def vllm_kv_bytes(cfg: RunConfig, arch: Mapping, gpus: int = 1) -> int:
    """The KV cache per GPU a vLLM sampler on `gpus` GPUs (its tensor_parallel_size) needs for the sequences it
    decodes at once (its rows in flight, at most sampler.vllm.max_num_seqs) x a rollout's prompt + completion x
    per-token KV; one of them at the engine's whole context (its max_model_len) when the OpenAI endpoint's is longer:
    vLLM refuses to start with a cache that cannot hold one sequence of max_model_len, and an endpoint request may be
    that long. Each GPU holds its share of the KV heads, at least one: with fewer KV heads than GPUs (Qwen2.5-1.5B's
    2 on tp 4) vLLM replicates them, so the cache does not shrink with tp below that."""
    s, gen = cfg.sampler, cfg.generation
    seqs = min(s.vllm.max_num_seqs, cfg.rows_in_flight())
    heads = -(-arch["num_kv_heads"] // gpus)
    per_token = 2 * arch["num_layers"] * heads * arch["head_dim"] * (2 if cfg.sampler_dtype() == "bfloat16" else 4)
    rollout = gen.max_prompt_tokens + gen.max_new_tokens
    return ((seqs - 1) * rollout + max(rollout, engine_context(cfg)[0])) * per_token


def _with_env(cfg: RunConfig, p: ProcessPlan, gpu_ids: tuple[str, ...], shared: bool,
              figures: dict | None) -> ProcessPlan:
    """The environment and overrides that carry the plan to process `p`."""
    env: dict[str, str] = {}
    overrides: list[str] = []
    if gpu_ids:  # indices as nvidia-smi numbers them (CUDA's own default order puts the fastest GPU first)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids[g] for g in p.gpus)
    if not p.jax_on_gpu:  # vLLM
        if gpu_ids:  # its own JAX only assembles weights on one CPU device: it must not take the GPU from vLLM
            env["JAX_PLATFORMS"] = "cpu"
        if p.share is not None and "gpu_memory_utilization" not in cfg.sampler.vllm.model_fields_set:
            overrides.append(f"sampler.vllm.gpu_memory_utilization={p.share}")
        if p.share is not None and figures and cfg.sampler.vllm.kv_cache_gib is None:
            # vLLM's kv_cache_memory_bytes is per GPU: the largest request set's cache, each GPU's KV heads
            kv = vllm_kv_bytes(cfg, figures["architecture"], len(p.gpus))
            overrides.append(f"sampler.vllm.kv_cache_gib={max(kv / GIB, 1 / 16):.3f}")
    elif p.share is not None or shared or cfg.hardware.shared_devices:
        env[PREALLOCATE] = "false"
        if p.share is not None:
            env[MEM_FRACTION] = f"{p.share:.3f}"
    return dataclasses.replace(p, env=env, overrides=tuple(overrides))


def load_figures(cfg: RunConfig) -> dict | None:
    """hardware.plan_json's document, checked to be `grpo-stream plan --json` output."""
    path = cfg.hardware.plan_json
    if path is None:
        return None
    try:
        doc = json.loads(pathlib.Path(path).read_text())
        doc["trainer"]["per_device_bytes"]["total"], doc["trainer"]["parameters"], doc["architecture"]["num_layers"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DeviceLayoutError(f"hardware.plan_json={path}: not a readable `grpo-stream plan --json` report "
                                f"({type(exc).__name__}: {exc}); write one with `grpo-stream plan --config C "
                                "--json F`, or set it to null") from None
    return doc


def detect_gpus(cfg: RunConfig, environ: Mapping[str, str]) -> tuple[list[str], int | None]:
    """(the host's ids of the GPUs this run may use, memory per GPU in bytes or None).

    hardware.gpus: that many (ids from CUDA_VISIBLE_DEVICES, else 0..n-1). Otherwise nvidia-smi's list, filtered by
    CUDA_VISIBLE_DEVICES; none when JAX_PLATFORMS names no GPU platform (the user chose the CPU)."""
    memory = (cfg.hardware.device_memory_bytes("trainer") if cfg.hardware.trainer_chip or
              cfg.hardware.trainer_memory_gib else None)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    listed = None if visible is None else [v.strip() for v in visible.split(",") if v.strip() not in ("", "-1")]
    if cfg.hardware.gpus is not None:
        if listed is not None and len(listed) < cfg.hardware.gpus:
            raise DeviceLayoutError(f"hardware.gpus={cfg.hardware.gpus}, but CUDA_VISIBLE_DEVICES={visible} shows "
                                    f"{len(listed)}; lower hardware.gpus or show more GPUs")
        ids = listed if listed is not None else [str(i) for i in range(cfg.hardware.gpus)]
        return ids[:cfg.hardware.gpus], memory
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not any(k in platforms for k in ("cuda", "gpu")):
        return [], memory
    smi = _nvidia_smi()
    if not smi:
        return [], memory
    memory = memory or min(m for _, _, m in smi)
    if listed is None:
        return [index for index, _, _ in smi], memory
    names = {index for index, _, _ in smi} | {uuid for _, uuid, _ in smi}
    return [v for v in listed if v in names], memory


def _nvidia_smi() -> list[tuple[str, str, int]]:
    """nvidia-smi's GPUs as (index, UUID, memory in bytes); [] without nvidia-smi or a driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index,uuid,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines()]
    return [(r[0], r[1], int(r[2]) << 20) for r in rows if len(r) == 3 and r[2].isdigit()]


def device_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings of `environ` that decide which devices a process uses and how much of them (for its log)."""
    keys = ("CUDA_VISIBLE_DEVICES", PREALLOCATE, MEM_FRACTION, "JAX_PLATFORMS")
    return {k: environ[k] for k in keys if k in environ}


def own_process_env(cfg: RunConfig, command: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What a process started without `up` (compose, Kubernetes) sets for itself before JAX starts: a vLLM sampler's
    own JAX on the CPU unless JAX_PLATFORMS says otherwise or the host is a TPU VM (vllm-tpu's model is JAX)."""
    tpu_host = any(pathlib.Path(p).exists() for p in ("/dev/accel0", "/dev/vfio/0"))
    if command == "sampler" and not engine_spec(cfg.sampler.engine).jax_mesh and "JAX_PLATFORMS" not in environ and not tpu_host:
        return {"JAX_PLATFORMS": "cpu"}
    return {}
