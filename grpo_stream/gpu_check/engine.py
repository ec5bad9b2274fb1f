"""gpu-check's engine phase: the ~1B runs' sampler engine alone on the device (`bench gpu engine`, bench/gpu.py),
which the runs' samplers' tokens/s are set against (issue 55; figures.engine_figures).

It is timed at two loads, the second first (a phase stopped at its cap keeps issue 55's figure): kept full (the
whole groups the run's sampler keeps in flight, its engine's slots by default), and holding the rows the synchronous
run's admission lets its sampler hold: trainer.max_staleness + 1 steps' groups (trainer_service/ingest/admission.py's
bound) or sampler.max_groups_per_version when lower, at most the full load.
The synchronous run's sampler has the device to itself while it generates, so against the second load its ratio
says what the rollout stream loses beyond admission's bound (issue 55's goal, >= 0.8, is read there); against the
first, how much of its engine the run kept busy, admission's bound included.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def engine_command(args: list[str], sync: list[str], cache: pathlib.Path, out_json: pathlib.Path,
                   deadline_s: float) -> tuple[list[str], int]:
    """(the `bench gpu engine` command for the run of `args` (`--config C` and KEY=VALUE overrides), the rows the
    synchronous run's admission allows: its overrides `sync`), the programs compiled into `cache`, the JSON to
    `out_json`, no load started after `deadline_s`."""
    from grpo_stream.common.config.loading import load_config  # noqa: PLC0415 - pydantic, only when the phase runs

    config, overrides = args[args.index("--config") + 1], [a for a in args if "=" in a]
    cfg = load_config(ROOT / config, [*overrides, *sync])
    full, t = cfg.rows_held(), cfg.trainer  # whole groups: 256 slots hold 252 rows of groups of 6
    groups = (t.max_staleness + 1) * t.groups_per_step  # admission's bound on the groups queued, all samplers
    if cfg.sampler.max_groups_per_version is not None:  # and a sampler's own, one version at a time
        groups = min(groups, cfg.sampler.max_groups_per_version)
    held = min(full, groups * cfg.generation.num_generations)
    sets = [x for o in [*overrides, f"runtime.compilation_cache_dir={cache}"] for x in ("--set", o)]
    cmd = [sys.executable, "-m", "grpo_stream.bench.gpu", "engine", "--config", config, "--out", str(out_json), *sets,
           "--deadline-s", f"{deadline_s:.0f}", "--rows", str(held), *(["--rows", str(full)] if held != full else [])]
    return cmd, held
