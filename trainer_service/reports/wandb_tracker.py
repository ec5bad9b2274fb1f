"""The Weights & Biases backend of the tracker interface (metrics.py), for trainer process 0 with
tracking.wandb.enabled. Imported only then: wandb is an optional extra (`pip install 'grpo-stream[wandb]'`).

One W&B run per trainer start (job type `trainer`, grouped by tracking.wandb.group or run.name, so a restarted
trainer's runs sit together). Each family of keys (train/, warmstart/, sampler/, samples/) has its own x axis
`<family>/step` (W&B's define_metric), logged with every record: warm-start and RL steps both count from 1, and a
resumed trainer logs steps again from its checkpoint, which W&B's single, increasing `step=` would drop.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.trainer_service.reports.metrics import Tracker

log = logging.getLogger(__name__)
SAMPLE_COLUMNS = ("step", "sampler", "group_id", "version", "staleness", "reward", "truncated", "prompt", "completion")
SAMPLES_KEY = "samples/completions"


class WandbTracker(Tracker):
    def __init__(self, cfg: RunConfig, run_dir: pathlib.Path):
        w = cfg.tracking.wandb
        try:
            import wandb  # noqa: PLC0415 - optional extra, only with tracking.wandb.enabled
        except ImportError:
            raise PermanentError("tracking.wandb.enabled needs the wandb package: pip install 'grpo-stream[wandb]' "
                                 "in the trainer's environment, or set tracking.wandb.enabled=false") from None
        self._wandb, self.samples_every, self.samples_max_rows = wandb, w.samples_every, w.samples_max_rows
        directory = pathlib.Path(w.dir or run_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a setting no restart fixes: permanent, so `up` does not restart the trainer on it
            raise PermanentError(f"tracking.wandb.dir={w.dir}: cannot make {directory} ({exc.strerror or exc}); give "
                                 "a directory the trainer can write, or null for the run directory") from exc
        try:
            self.run, mode = _start(wandb, cfg, directory, w.mode), w.mode
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as exc:
            raise PermanentError(f"tracking.wandb: W&B refused to start the run ({exc}); log in (`wandb login` or "
                                 "$WANDB_API_KEY), or use tracking.wandb.mode=offline and `wandb sync` later") from exc
        except wandb.errors.CommError as exc:
            # no answer within W&B's init_timeout (no network, W&B down), or another error talking to the server: W&B
            # is a copy of the run's own files, so it must not stop the run (exit 3: this error is of no transient
            # kind) nor cost every restart the same wait; the run is recorded offline, for `wandb sync` later
            log.warning("tracking.wandb: W&B could not start the online run (%s); logging this trainer to an offline "
                        "W&B run under %s instead: upload it later with `wandb sync %s`", str(exc).splitlines()[0],
                        directory / "wandb", directory / "wandb" / "offline-run-*")
            self.run, mode = _start(wandb, cfg, directory, "offline"), "offline"
        self._axes: set[str] = set()
        log.info("W&B run %s (%s, project %s) in %s", self.run.id, mode, w.project, directory / "wandb")

    def _log(self, family: str, step: int, data: dict[str, Any]) -> None:
        """`data` (keys under `family/`) at `step` of the family's own x axis, `family/step`."""
        axis = f"{family}/step"
        if family not in self._axes:
            self.run.define_metric(axis)
            self.run.define_metric(f"{family}/*", step_metric=axis)
            self._axes.add(family)
        self.run.log({**data, axis: step})

    def scalars(self, step: int, values: dict[str, float], prefix: str = "", jsonl: bool = True) -> None:
        # W&B keeps every scalar, whatever `jsonl` says: that flag is about the JSONL file's size
        keys = {f"{prefix}{k}": float(v) for k, v in values.items()}
        for family in {key.split("/", 1)[0] for key in keys}:
            self._log(family, step, {k: v for k, v in keys.items() if k.split("/", 1)[0] == family})

    def histogram(self, step: int, name: str, values) -> None:
        self._log(name.split("/", 1)[0], step, {name: self._wandb.Histogram(np.asarray(values))})

    def samplers(self, step: int, figures: dict[str, dict[str, float]]) -> None:
        if figures:
            self._log("sampler", step, {f"sampler/{sampler}/{figure}": float(value)
                                        for sampler, values in figures.items() for figure, value in values.items()})

    def config(self, resolved: dict[str, Any]) -> None:
        self.run.config.update(resolved, allow_val_change=True)

    def samples_wanted(self, step: int) -> int:
        return self.samples_max_rows if self.samples_every and step % self.samples_every == 0 else 0

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            table = self._wandb.Table(columns=list(SAMPLE_COLUMNS),
                                      data=[[step if c == "step" else row[c] for c in SAMPLE_COLUMNS]
                                            for row in rows[:self.samples_max_rows]])
            self._log("samples", step, {SAMPLES_KEY: table})

    def summary(self, values: dict[str, Any]) -> None:
        self.run.summary.update(values)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _start(wandb, cfg: RunConfig, directory: pathlib.Path, mode: str):
    """wandb.init of the trainer's run in `mode`. Console capture off: `up` already keeps each process's output in
    RUN_DIR/logs; W&B's would wrap it. create_new: several trainers in one process (tests, benchmarks) each get a
    run of their own. No system metadata: it holds the command line, where `up` and compose put every override (a
    secret the config's redaction hides would reach W&B there)."""
    w = cfg.tracking.wandb
    return wandb.init(project=w.project, entity=w.entity, mode=mode, dir=str(directory), group=w.group or cfg.run.name,
                      name=w.name or cfg.run.name, job_type="trainer", reinit="create_new",
                      settings=wandb.Settings(console="off", x_disable_meta=True))
