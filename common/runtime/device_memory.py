"""A process's device memory as its allocator counts it, for the files a run leaves (the trainer's summary.json, each
sampler's sampler-<index>.json): `scripts/gpu-check.sh` compares the peaks with `grpo-stream plan`'s figures."""

from __future__ import annotations

from typing import Any


def device_memory(device: Any = None) -> dict[str, int] | None:
    """{peak_bytes_in_use, bytes_limit} of `device` (default: this process's first local device) since the process
    started; None where the backend keeps no such statistics (the CPU)."""
    import jax  # noqa: PLC0415 - deferred: only processes that already run JAX call this

    device = device if device is not None else jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without statistics may raise instead of returning None
        return None
    if not stats:
        return None
    return {key: int(stats[key]) for key in ("peak_bytes_in_use", "bytes_limit") if key in stats} or None


def host_memory() -> dict[str, int]:
    """{peak_resident_bytes}: this process's peak resident memory since it started (the kernel's high-water mark).
    On the CPU the devices' arrays live there too, so it is what `grpo-stream plan` on CPU (hardware.*_chip=cpu)
    estimates per process (docs/plan.md)."""
    import resource  # noqa: PLC0415 - POSIX only; deferred so importing this module stays portable

    return {"peak_resident_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}  # KiB on Linux
