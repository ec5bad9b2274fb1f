"""`grpo-stream report RUN_DIR`: PNG plots and a markdown summary of a finished (or running) run.

Reads RUN_DIR/metrics-trainer.jsonl (one row per RL step) and RUN_DIR/summary.json when present;
writes RUN_DIR/report/*.png and RUN_DIR/report/report.md.
"""

from __future__ import annotations

import json
import pathlib

PLOTS = {
    "reward_accuracy": ("Reward and accuracy", ["train/reward_mean", "train/accuracy"]),
    "kl": ("Policy movement", ["train/ppo_kl", "train/kl", "train/clip_fraction"]),
    "staleness": ("Staleness (steps)", ["train/staleness_mean", "train/staleness_max"]),
    "throughput": ("Throughput", ["train/tokens_per_second"]),
    "buffer_depth": ("Rollout buffer", ["train/buffer_depth", "train/groups_dropped_stale"]),
}


def load_rows(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics-trainer.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: RUN_DIR must be a directory written by `grpo-stream up` or "
                                "`grpo-stream trainer --run-dir`")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "train/loss" in r]


def _smooth(values, window: int = 20) -> list[float]:
    """Trailing moving average, so trends show through per-step noise."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def make_report(run_dir: pathlib.Path) -> pathlib.Path:
    import matplotlib  # noqa: PLC0415 - only this command needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = load_rows(run_dir)
    if not rows:
        raise ValueError(f"{run_dir}: no RL steps logged yet")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    steps = [r["step"] for r in rows]
    images = []
    for name, (title, keys) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for key in keys:
            points = [(s, r[key]) for s, r in zip(steps, rows) if key in r]
            if points:
                xs, ys = zip(*points)
                line, = ax.plot(xs, ys, linewidth=0.8, alpha=0.35)
                ax.plot(xs, _smooth(ys), color=line.get_color(), linewidth=1.6, label=key.removeprefix("train/"))
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        images.append(f"{name}.png")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    lines = [f"# Run report: {summary.get('run', run_dir.name)}", ""]
    if summary:
        before = (summary.get("eval_before") or {}).get("accuracy")
        after = (summary.get("eval_after") or {}).get("accuracy")
        pass1_before = ((summary.get("eval_before") or {}).get("pass_at_k") or {}).get("1")  # with eval.samples
        pass1_after = ((summary.get("eval_after") or {}).get("pass_at_k") or {}).get("1")
        lines += [
            "| figure | value |", "|---|---|",
            f"| RL steps | {summary.get('steps')} |",
            f"| held-out accuracy before → after | {before} → {after} |",
            *([f"| held-out sampled pass@1 before → after | {pass1_before} → {pass1_after} |"]
              if pass1_before is not None else []),
            f"| groups ingested | {summary.get('groups_ingested')} |",
            f"| trained / dropped stale / filtered / left | {summary.get('groups_trained')} / "
            f"{summary.get('groups_dropped_stale')} / {summary.get('groups_dropped_filtered')} / "
            f"{summary.get('groups_left_in_buffer')} |",
            f"| weight versions published | {summary.get('weight_versions_published')} |",
            f"| wall seconds | {summary.get('wall_seconds')} |", ""]
    last = rows[-1]
    lines += [f"Last step ({last['step']}): reward {last['train/reward_mean']:.3f}, "
              f"accuracy {last['train/accuracy']:.3f}, staleness {last['train/staleness_mean']:.2f}.", ""]
    lines += [f"![{name}]({name})" for name in images]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return out
