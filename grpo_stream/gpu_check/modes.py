"""What a GPU run of `scripts/gpu-check.sh` and its CPU dry run differ in (`Mode`), each phase's time, and where the
~1B runs' checkpoints go."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time

from grpo_stream.gpu_check.model import SHAPE


@dataclasses.dataclass(frozen=True)
class Mode:
    """What the GPU run and the dry run differ in."""

    shape: str  # of the ~1B phases' model
    demo: tuple[str, ...]  # `up` arguments of the learning demo
    big: tuple[str, ...]  # overrides of the ~1B phases beyond the shared ones
    steps: int  # RL steps of each ~1B phase
    groups_per_step: int
    deadline_s: float
    caps: dict  # phase -> the most seconds it may take
    stop_grace_s: float  # what a stopped run gets to end (its trainer checkpoints and writes summary.json)
    learning_bar: float | None  # held-out greedy accuracy gain the demo must reach (None: reported, not checked)
    # an optional phase's least time from its start to its stop, in which it can give its figures: with less it is
    # skipped for the deadline, as started it would spend the lent device's time and give none (default 10 s)
    min_run_s: dict = dataclasses.field(default_factory=dict)


# 570 s from the script's start (setup_seconds): issue 40's 480, the engine alone (issue 55) and the wheels' install
# (about 30 s), with room to end and clean up inside the device tool's 600 s a call; 16 steps a ~1B run (20 before)
# leave the engine its 90 s
GPU = Mode(shape=SHAPE, steps=16, groups_per_step=8, deadline_s=570.0, stop_grace_s=45.0, learning_bar=0.10,
           # the demo as shipped: `up`'s device plan puts its three processes on the one GPU with a share each
           demo=("--config", "configs/tiny_arith.yaml"),
           # GSM8K's prompt lengths and the preset's batch; 256 new tokens, not 512, to fit the runs in the deadline
           big=("generation.max_new_tokens=256",),
           # from the first H200 run (2026-11-27): demo 113 s; a ~1B run ~60 s to its first step (compiles), ~3 s a
           # step after, ~45 s to stop (export, final wait); 30 steps overran 140 s caps, 20 fit these; the engine
           # alone: a model load, two loads' compiles and runs
           caps={"demo": 150.0, "async": 180.0, "sync": 150.0, "engine": 90.0, "colocated": 120.0,
                 "realmodel": 420.0},
           # the one-process run: 38 s from its start (its programs in the compilation cache) gave one step on
           # 2026-11-28; the figures need WARMUP_STEPS + 1 steps at ~3 s each
           min_run_s={"colocated": 60.0})
# 330 s: 300 for the phases as before the deadline counted the setup (the import check: ~30 s on 2 busy cores)
DRY = Mode(shape="tiny", steps=6, groups_per_step=4, deadline_s=330.0, stop_grace_s=20.0, learning_bar=None,
           demo=("--config", "configs/tiny_arith_smoke.yaml", "sampler.replicas=1", "trainer.steps=4",
                 "warmstart.steps=0", "eval.num_problems=16", "eval.batch_size=16"),
           big=("generation.max_new_tokens=16", "task.dataset.limit=400"),
           caps={"demo": 100.0, "async": 110.0, "sync": 80.0, "engine": 60.0, "colocated": 80.0, "realmodel": 280.0})
CHIPS = {"H200": "h200", "H100": "h100-80gb", "A100": "a100-80gb"}  # device_kind -> hardware.trainer_chip


def setup_seconds(started_unix: str | None, now: float | None = None) -> float:
    """Seconds since `started_unix` (scripts/gpu-check.sh's start, $GPU_CHECK_STARTED): the wheels' install and the
    import check before the check's process, inside the deadline too (it bounds the device tool's call). 0 when unset,
    unreadable, or not within the last hour (a value left in a shell, not this script's)."""
    try:
        elapsed = (time.time() if now is None else now) - float(started_unix or "")
    except ValueError:
        return 0.0
    return elapsed if 0 <= elapsed <= 3600 else 0.0


def memory_dir(name: str, needed: int = 40 << 30) -> pathlib.Path | None:
    """A directory in /dev/shm when it has `needed` bytes free (the ~1B runs' checkpoints: bfloat16 parameters with
    float32 master copy and Adam moments, about 17 GB, written at the last step), else None (the run directory)."""
    shm = pathlib.Path("/dev/shm")
    try:
        return shm / name if shm.is_dir() and shutil.disk_usage(shm).free >= needed else None
    except OSError:
        return None
