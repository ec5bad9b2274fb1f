"""Device meshes and parameter shardings of the two services, and multi-host start-up.

The trainer runs FSDP x tensor parallel on a (`fsdp`, `tp`) mesh; a sampler
runs tensor parallel on its own (`fsdp`=1, `tp`) mesh, and replicas are
separate samplers. Tunix annotates every parameter with logical axes named
`fsdp` and `tp`, so one rule gives each parameter its NamedSharding on either
mesh. An axis that does not divide a dimension (e.g. 2 KV heads on tp=4) is
dropped for that dimension: the dimension is replicated rather than refused.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import os
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)
AXES = ("fsdp", "tp")


def make_mesh(fsdp: int, tp: int, devices: Sequence[jax.Device], field: str) -> Mesh:
    """A (fsdp, tp) mesh over exactly fsdp*tp of `devices`; `field` names the config setting in errors."""
    need = fsdp * tp
    if need > len(devices):
        raise ValueError(f"{field}: fsdp x tp = {fsdp} x {tp} = {need} devices, but this process has "
                         f"{len(devices)} ({devices[0].platform}); lower the mesh or give the process more devices "
                         "(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    grid = np.asarray(spread_over_processes(devices, need), dtype=object).reshape(fsdp, tp)
    return Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def spread_over_processes(devices: Sequence[jax.Device], need: int) -> list[jax.Device]:
    """`need` of `devices`, an equal share from every process they belong to (each process's first ones): a mesh of
    a multi-process trainer must hold devices of every process, also where a process sees more devices than its
    share (XLA_FLAGS' host device count set for all processes alike). One process: the first `need`."""
    processes = sorted({d.process_index for d in devices})
    if len(processes) == 1 or need % len(processes):
        return list(devices)[:need]
    share = need // len(processes)
    picked = []
    for p in processes:
        own = [d for d in devices if d.process_index == p]
        if len(own) < share:
            raise ValueError(f"trainer process {p} has {len(own)} devices, fewer than its share of the mesh "
                             f"({need} devices over {len(processes)} processes = {share} each): give every process "
                             "as many devices (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        picked.extend(own[:share])
    return picked


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """`spec` with every mesh axis that does not divide its dimension removed."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        kept = [a for a in _axis_names(axes) if mesh.shape[a] > 1]
        size = math.prod(mesh.shape[a] for a in kept)
        if kept and dim % size:
            kept = []
        fitted.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*fitted)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """A pytree like `params` of NamedShardings from Tunix's (fsdp, tp) annotations, fitted to the shapes. Where the
    fitting keeps parameters whole over a mesh axis, the log says which setting did it and how much memory it costs
    (`kept_whole`)."""
    annotated = nnx.get_named_sharding(params, mesh)
    fitted = jax.tree.map(lambda leaf, s: NamedSharding(mesh, fit_spec(s.spec, tuple(leaf.shape), mesh)), params,
                          annotated)
    report_kept_whole(kept_whole(jax.tree.leaves(params), [s.spec for s in jax.tree.leaves(annotated)],
                                 [s.spec for s in jax.tree.leaves(fitted)], mesh), mesh)
    return fitted


# what each mesh axis's size is set by, for the log: the trainer's fsdp; tp is the trainer's or a sampler's
AXIS_SETTINGS = {"fsdp": "trainer.mesh.fsdp", "tp": "trainer.mesh.tp / sampler.mesh.tp"}
# a share of the parameters' bytes kept whole over an axis at or above which that is a warning, not a note: FSDP
# meant to split all of them (on a 70B model every device would hold the whole model), or tp meant to split the
# attention heads; KV heads fewer than tp (replicated as tensor parallelism does) stay below it
KEPT_WHOLE_WARNING_SHARE = 0.1
_REPORTED: set[tuple] = set()


def kept_whole(leaves: Sequence[Any], annotated: Sequence[PartitionSpec], fitted: Sequence[PartitionSpec],
               mesh: Mesh) -> dict[str, dict]:
    """Per mesh axis that the fitting dropped somewhere: {"dims": the dimension sizes it does not divide,
    "parameters": how many parameters, "bytes": theirs, "total_bytes": all of `leaves`'}."""
    total = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves)
    out: dict[str, dict] = {}
    for leaf, want, got in zip(leaves, annotated, fitted):
        dropped = {}
        for dim, w, g in zip(leaf.shape, tuple(want) + (None,) * len(leaf.shape),
                             tuple(got) + (None,) * len(leaf.shape)):
            for axis in set(_axis_names(w)) - set(_axis_names(g)):
                if mesh.shape[axis] > 1:
                    dropped[axis] = dim
        for axis, dim in dropped.items():
            entry = out.setdefault(axis, {"dims": set(), "parameters": 0, "bytes": 0, "total_bytes": total})
            entry["dims"].add(dim)
            entry["parameters"] += 1
            entry["bytes"] += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    return out


def report_kept_whole(report: dict[str, dict], mesh: Mesh) -> None:
    """Log `kept_whole`'s report once per process and layout: a warning when an axis keeps at least
    KEPT_WHOLE_WARNING_SHARE of the bytes whole, with the setting to change."""
    for axis, entry in report.items():
        key = (axis, mesh.shape[axis], tuple(sorted(entry["dims"])), entry["parameters"], entry["bytes"])
        if key in _REPORTED:
            continue
        _REPORTED.add(key)
        share = entry["bytes"] / max(1, entry["total_bytes"])
        level = logging.WARNING if share >= KEPT_WHOLE_WARNING_SHARE else logging.INFO
        dims = ", ".join(str(d) for d in sorted(entry["dims"]))
        log.log(level, "%s=%d does not divide dimension(s) %s of %d parameters (%.1f%% of the parameters' bytes, "
                "%.3g GiB): every %s device keeps them whole; choose a size dividing %s to split them",
                AXIS_SETTINGS.get(axis, axis), mesh.shape[axis], dims, entry["parameters"], 100 * share,
                entry["bytes"] / 2**30, axis, dims)


def _axis_names(axes: Any) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes or ())


def place(params: Any, mesh: Mesh) -> Any:
    """`params` (host or device arrays) moved onto their shardings on `mesh`."""
    if not mesh.is_multi_process:
        return jax.device_put(params, param_shardings(params, mesh))
    # a mesh over several processes (multi-process trainer): from host copies, which every process holds alike.
    # (jax 0.10 device_put of a one-device array onto a sharding replicated over processes of one device each
    # builds an array whose shards cannot be read back.)
    host = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable else x, params)
    return jax.device_put(host, param_shardings(params, mesh))


def host_copy(arr: Any) -> np.ndarray:
    """The whole of `arr` as a host array. An array spread over several processes (a multi-process trainer's
    mesh) is gathered, a collective: every process calls this for the same arrays in the same order."""
    if isinstance(arr, jax.Array) and not arr.is_fully_addressable and arr.is_fully_replicated:
        return np.asarray(arr.addressable_data(0))  # every process holds all of it: no collective needed
    if isinstance(arr, jax.Array) and not arr.is_fully_addressable:
        from jax.experimental import multihost_utils  # noqa: PLC0415 - deferred: multi-host arrays only

        return np.asarray(multihost_utils.process_allgather(arr, tiled=True))
    return np.asarray(jax.device_get(arr))


def rows_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """Batch rows split over `fsdp` (data parallel) when they divide evenly, else replicated."""
    fsdp = mesh.shape["fsdp"]
    return NamedSharding(mesh, PartitionSpec("fsdp") if fsdp > 1 and rows % fsdp == 0 else PartitionSpec())


def needed_slices(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> list[tuple[slice, ...]]:
    """The distinct index slices this process's devices hold of an array of `shape` (normalised, in order)."""
    seen: dict[tuple, tuple[slice, ...]] = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        norm = normalized(index, shape)
        seen.setdefault(tuple((s.start, s.stop) for s in norm), norm)
    return list(seen.values())


def normalized(index: tuple[slice, ...], shape: Sequence[int]) -> tuple[slice, ...]:
    """A device's index of an array of `shape` with explicit starts and stops (no None)."""
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def split_devices(devices: Sequence[jax.Device], trainer_fraction: float,
                  sampler_fraction: float) -> tuple[list[jax.Device], list[jax.Device]]:
    """Single-controller split: the trainer takes the first share of the devices, samplers the last share.

    Both fractions 1.0 means both use every device (one shared mesh). Fractions summing to at most 1.0 never
    overlap, even where both round up (3 devices at 0.5 + 0.5: 2 and 1).
    """
    n = len(devices)
    if trainer_fraction == 1.0 and sampler_fraction == 1.0:
        return list(devices), list(devices)
    n_train, n_sample = max(1, int(round(n * trainer_fraction))), max(1, int(round(n * sampler_fraction)))
    # shares that sum to at most 1.0 but rounded up past n: the samplers', then the trainer's, shrink to fit
    if trainer_fraction + sampler_fraction <= 1.0 + 1e-9:
        n_sample = max(1, min(n_sample, n - n_train))
        n_train = min(n_train, n - n_sample)
    fractions = (f"weights.trainer_devices_fraction={trainer_fraction} + weights.sampler_devices_fraction="
                 f"{sampler_fraction}")
    if trainer_fraction + sampler_fraction > 1.0 + 1e-9 and n_train + n_sample > n:
        raise ValueError(f"{fractions} take {n_train} + {n_sample} of {n} devices; make them sum to at most 1.0, or "
                         "set both to 1.0 to share one mesh")
    if n_train < 1:
        raise ValueError(f"{fractions}: {n} device(s) cannot be split between the trainer and the samplers; set "
                         "both to 1.0 to share one mesh, or give the process more devices")
    return list(devices[:n_train]), list(devices[n - n_sample:])


def coordinator_bind_address(coordinator: str, environ: Mapping[str, str]) -> str | None:
    """Where process 0's coordination service listens. JAX binds every interface ([::]:port) unless told, and its
    key-value store takes writes from anyone who reaches it, so: JAX_COORDINATOR_BIND_ADDRESS when set (e.g. the pod
    IP and port), else the coordinator address itself when that is a loopback one (all processes on this host, as
    `up` runs them); None leaves JAX's default, which a job across hosts needs (keep that port inside the job with a
    network policy)."""
    if environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return environ["JAX_COORDINATOR_BIND_ADDRESS"]
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return coordinator
    try:
        return coordinator if ipaddress.ip_address(host).is_loopback else None
    except ValueError:  # a host name
        return None


def initialize_distributed(mode: str) -> bool:
    """Multi-host JAX start-up from the environment; True when this process joined a multi-process job.

    `auto` initialises when the environment describes a job (JAX_COORDINATOR_ADDRESS, or a Cloud TPU / SLURM /
    Kubernetes JobSet that jax.distributed detects itself: TPU_WORKER_HOSTNAMES with more than one host, or
    SLURM_JOB_ID); `always` initialises unconditionally (auto-detection must succeed); `never` skips it.
    """
    if mode == "never":
        return False
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
    multi_tpu = "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if mode == "auto" and not (coordinator or multi_tpu or os.environ.get("SLURM_JOB_ID")):
        return False
    kwargs: dict[str, Any] = {}
    if coordinator:
        for env, key in (("JAX_NUM_PROCESSES", "num_processes"), ("JAX_PROCESS_ID", "process_id")):
            if env not in os.environ:
                raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {env} is not: set both {env} and the other "
                                 "of JAX_NUM_PROCESSES / JAX_PROCESS_ID, or unset JAX_COORDINATOR_ADDRESS")
            kwargs[key] = int(os.environ[env])
        kwargs["coordinator_address"] = coordinator
        bind = coordinator_bind_address(coordinator, os.environ)
        if bind:
            kwargs["coordinator_bind_address"] = bind
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices of several processes: over TCP
    jax.distributed.initialize(**kwargs)
    log.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True
