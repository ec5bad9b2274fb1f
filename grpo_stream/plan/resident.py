"""The plan child's own resident memory, for the CPU estimate of a process's peak (hardware.*_chip=cpu,
host_memory.py): what a run's process holds before it loads any weights (the Python runtime, JAX, the project's
modules, the task and tokenizer) and what compiling its programs costs, measured here rather than assumed, since both
depend on the libraries installed and the model's shape.

Linux only (/proc/self/status); elsewhere the measurements are None and the estimate says so.
"""

from __future__ import annotations

import ctypes
import importlib
import pathlib
from typing import Any, Callable

STATUS = pathlib.Path("/proc/self/status")
CLEAR_REFS = pathlib.Path("/proc/self/clear_refs")


def resident() -> dict[str, int] | None:
    """{now, peak}: this process's resident bytes (VmRSS) and its high-water mark (VmHWM), or None off Linux."""
    try:
        fields = dict(line.split(":", 1) for line in STATUS.read_text().splitlines() if ":" in line)
        return {"now": int(fields["VmRSS"].split()[0]) << 10, "peak": int(fields["VmHWM"].split()[0]) << 10}
    except (OSError, KeyError, ValueError):
        return None


def reset_peak() -> bool:
    """Give the allocator's free memory back to the kernel (glibc's malloc_trim) and lower the high-water mark to
    the resident bytes now (Linux's clear_refs 5), so a later peak is the next phase's alone, not memory an earlier
    phase freed and the next one reuses; False where the kernel does not allow it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the allocator keeps what it keeps
        pass
    try:
        CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def runtime_bytes(cfg) -> dict[str, Any]:
    """What every trainer and sampler process holds before its weights: the services' modules imported and the
    run's task and tokenizer built (a Hugging Face tokenizer brings `transformers`, hundreds of MB). A checkpoint
    whose tokenizer is not on this machine (a preset named by its hub id) is measured without it, and says so."""
    from grpo_stream.common.runtime.process import import_tensorboardx_without_torch  # noqa: PLC0415

    import_tensorboardx_without_torch()
    for module in ("grpo_stream.sampler_service.loop", "grpo_stream.trainer_service.loop"):
        importlib.import_module(module)  # what a sampler and a trainer process import
    from grpo_stream.common.assembly.parts import build_task_and_tokenizer  # noqa: PLC0415

    note = None
    try:
        build_task_and_tokenizer(cfg)
    except (OSError, ValueError) as exc:
        note = f"without the task and tokenizer, which could not be built here ({type(exc).__name__}: {exc})"
    now = resident()
    return {"bytes": now["now"] if now else None, "note": note}


def compile_growth(compile_programs: Callable[[], Any], nested: bool = False) -> tuple[Any, dict[str, int] | None]:
    """(compile_programs(), {peak, retained}): how far this process's resident memory rose above where it stood while
    the programs compiled (the compiler's working memory and the executables), and how much of it stayed. `nested`:
    inside another measurement, whose high-water mark is left alone (the peak is then what stayed)."""
    exact = nested or reset_peak()
    before = resident()
    out = compile_programs()
    after = resident()
    if before is None or after is None or not exact:
        return out, None
    retained = max(0, after["now"] - before["now"])
    return out, {"peak": retained if nested else max(0, after["peak"] - before["now"]), "retained": retained}
