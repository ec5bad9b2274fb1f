"""What an `up` run with tracking.wandb (offline) must have put in its W&B run, read back from RUN_DIR/wandb."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.wandb_offline import offline_runs, read_run

# an `up` run's overrides for an offline W&B run of the trainer, a sample table every 4 steps
WANDB_OFFLINE = ("tracking.wandb.enabled=true", "tracking.wandb.mode=offline",
                 "tracking.wandb.project=grpo-stream-test", "tracking.wandb.samples_every=4",
                 "tracking.wandb.samples_max_rows=6")


def wandb_env(root: pathlib.Path) -> dict[str, str]:
    """W&B's settings, cache and artifact staging under the test's directory, not the user's home."""
    return {"WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(root / "wandb-home" / "config"),
            "WANDB_CACHE_DIR": str(root / "wandb-home" / "cache"), "WANDB_DATA_DIR": str(root / "wandb-home" / "data")}


def check_wandb_run(run_dir: pathlib.Path, steps: int, samplers: list[str]) -> None:
    """One W&B run (trainer process 0's), finished, holding the resolved config, every train/* key of
    metrics-trainer.jsonl at every step with the same values, each sampler's weight lag, text sample tables every
    4 steps and the trainer's summary.json."""
    (directory,) = offline_runs(run_dir)
    run = read_run(directory)
    assert run.run["project"] == "grpo-stream-test" and run.run["exit_code"] == 0, run.run
    config = run.config
    assert config["trainer"]["steps"] == steps and config["trainer"]["optimizer"]["name"] == "adamw"
    assert config["tracking"]["wandb"]["mode"] == "offline"
    rows = [json.loads(line) for line in (run_dir / "metrics-trainer.jsonl").read_text().splitlines()]
    jsonl = {r["step"]: {k: v for k, v in r.items() if k.startswith("train/")} for r in rows if "train/loss" in r}
    logged = {r["train/step"]: {k: v for k, v in r.items() if k != "train/step" and k != "train/staleness"
                                and k.startswith("train/")} for r in run.history if "train/loss" in r}
    assert sorted(logged) == sorted(jsonl) == list(range(1, steps + 1))
    for step, values in jsonl.items():
        assert logged[step] == pytest.approx(values, nan_ok=True), step
    assert {"train/loss", "train/reward_mean", "train/staleness_mean", "train/weight_version"} <= set(logged[1])
    assert run.column("warmstart/step")  # the warm start's curve, on its own axis
    assert {f"sampler/{s}/weight_lag" for s in samplers} <= run.keys()
    tables = [(r["samples/step"], run.table(r["samples/completions"])) for r in run.history
              if "samples/completions" in r]
    assert [step for step, _ in tables] == list(range(4, steps + 1, 4))
    for step, table in tables:
        assert len(table) == 6 and all(row["step"] == step for row in table)
        assert all(row["prompt"].startswith("Q: ") and row["prompt"].endswith(" A:") for row in table), table[0]
        assert all(isinstance(row["completion"], str) and 0.0 <= row["reward"] <= 1.0 for row in table)
        assert all(0 <= row["version"] < step and row["staleness"] == step - 1 - row["version"] for row in table)
    # the trainer's summary.json (`up` completes the file afterwards: compare what the trainer wrote)
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("steps", "groups_trained", "groups_ingested", "weight_versions", "eval_after"):
        assert run.summary[key] == summary[key], key
    for sampler in samplers:
        assert run.summary[f"sampler/{sampler}/groups_ingested"] == summary["groups_by_sampler"][sampler]
