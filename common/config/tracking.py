"""The config section of experiment trackers beyond the files every run writes (TensorBoard events and
metrics-<process>.jsonl in RUN_DIR): Weights & Biases, which the trainer feeds when `tracking.wandb.enabled`
(trainer_service/reports/metrics.py: the tracker interface; docs/tracking.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from grpo_stream.common.config.base import FilePath, Strict

_PROJECT_FORBIDDEN = "/\\#?%:"  # characters W&B refuses in a project name, only when the run is created


class WandbSection(Strict):
    """One W&B run per trainer start, written by trainer process 0 only (the other processes of a multi-process
    trainer log nothing there): the resolved config, every step's train/* scalars, each sampler's weight lag, a
    table of sample completions and, at the end, summary.json."""

    enabled: bool = Field(False, description="Log the trainer to Weights & Biases (needs the `wandb` extra: "
                          "pip install 'grpo-stream[wandb]'). Off: wandb is never imported.")
    project: str = Field("", max_length=128, validate_default=True, description="The W&B project the runs go to; "
                         "required when tracking.wandb.enabled.")
    entity: str | None = Field(None, max_length=128, description="The W&B team or user that owns the project; null: "
                               "the logged-in user's default entity.")
    mode: Literal["online", "offline"] = Field("online", description="'online': stream to the W&B server (needs "
                                               "`wandb login` or $WANDB_API_KEY); 'offline': write the run under "
                                               "tracking.wandb.dir only, for `wandb sync` later (no network).")
    group: str | None = Field(None, max_length=128, description="The W&B group of the run; null: run.name, so the "
                              "W&B runs of one run's trainer restarts sit together.")
    name: str | None = Field(None, max_length=128, description="The W&B run's display name; null: run.name.")
    dir: FilePath = Field(None, description="Where W&B writes its files (a `wandb/` folder is made inside); "
                            "null: the run directory (RUN_DIR/wandb).")
    samples_every: int = Field(50, ge=0, le=1_000_000, description="Every this many RL steps, log a table of the "
                               "step's sample completions (prompt and completion text, reward, staleness, weight "
                               "version, sampler); 0: never.")
    samples_max_rows: int = Field(64, ge=1, le=10_000, description="Rows (completions) of each sample table at "
                                  "most: whole groups in the step's order, the last one cut at the cap.")
    samples_injected: bool = Field(False, description="Put groups of injected prompts (what clients sent through "
                                   "PromptService) in the sample tables too; off: the run's own prompts only.")

    @field_validator("project")
    @classmethod
    def _project(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("enabled") and not value.strip():
            raise ValueError("empty while tracking.wandb.enabled=true; name the W&B project the runs go to (e.g. "
                             "tracking.wandb.project=grpo-stream), or set tracking.wandb.enabled=false")
        bad = sorted({c for c in value if c in _PROJECT_FORBIDDEN})
        if bad:
            raise ValueError(f"{value!r} holds {''.join(bad)!r}, which W&B refuses in a project name; use letters, "
                             "digits, '-', '_' and '.'")
        return value.strip()


class TrackingSection(Strict):
    wandb: WandbSection = Field(default_factory=WandbSection, description="Weights & Biases (null or enabled=false: "
                                "off).")

    @field_validator("wandb", mode="before")
    @classmethod
    def _null_is_off(cls, value):
        # `wandb:` with nothing under it in YAML reads as null: the section left empty means off
        return {} if value is None else value
