"""`grpo-stream report RUN_DIR`: PNG plots and a markdown summary of a finished (or running) run.

Reads RUN_DIR/metrics-trainer.jsonl (one row per RL step, one per held-out evaluation: before RL at step 0,
every eval.every_steps during it, after it; and the warm start's rows, not plotted) and RUN_DIR/summary.json when
present; writes RUN_DIR/report/*.png and RUN_DIR/report/report.md.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

from grpo_stream.common.runtime.files import to_json, write_atomic

# plot name -> (title, series). Every series is plotted only if it moves; one that is constant over the run is
# listed in report.md with its value and, where CONSTANT_BECAUSE knows, why (and the plots.json index says so).
# A series ending in "*" stands for every logged key it prefixes (per-lag series: their number follows
# trainer.max_staleness), in numeric order; so may a CONSTANT_BECAUSE key.
PLOTS = {
    "reward_accuracy": ("Reward and accuracy (training batches)", ["train/reward_mean", "train/accuracy"]),
    "off_policy": ("Off-policy correction", ["train/is_weight_mean", "train/is_weight_min", "train/ratio_max",
                                             "train/ratio_min", "train/clip_fraction", "train/clip_fraction_low",
                                             "train/clip_fraction_high", "train/ppo_kl"]),
    "staleness": ("Staleness of trained groups (steps)", ["train/staleness_mean", "train/staleness_max"]),
    "update": ("Policy update", ["train/grad_norm", "train/entropy", "train/advantage_abs_mean"]),
    "lengths": ("Completions", ["train/response_length_mean", "train/truncated_fraction"]),
    # groups/s is tokens/s over the mean length (the lengths plot), and on this axis it would be a flat line
    "throughput": ("Completion tokens trained per second (30 s window)", ["train/tokens_per_second"]),
    "buffer": ("Rollout buffer", ["train/buffer_depth", "train/groups_dropped_stale"]),
    # trainer_service/learning/off_policy_health.py; docs/objective.md, "Off-policy health"
    "off_policy_health": ("Off-policy health: importance-weight ESS, sampler-trainer KL, ratio quantiles",
                          ["train/is_ess_group_mean", "train/is_ess_group_min", "train/is_ess_sequence",
                           "train/is_ess_token", "train/mismatch_kl_k3", "train/mismatch_kl_k1",
                           "train/is_ratio_p01", "train/is_ratio_p10", "train/is_ratio_p50", "train/is_ratio_p90",
                           "train/is_ratio_p99", "train/is_truncated_fraction"]),
    "staleness_by_version": ("Share of trained tokens by version lag (steps)",
                             ["train/staleness_tokens_lag*", "train/mixed_version_tokens_lag*"]),
    "mixed_versions": ("Trained groups whose tokens mix weight versions", ["train/mixed_version_groups"]),
    # distill.teacher runs only; docs/objective.md, "On-policy distillation"
    "distillation": ("On-policy distillation: per-token KL to the teacher (mean, quantiles), teacher log-prob",
                     ["train/distill_kl", "train/distill_kl_p50", "train/distill_kl_p90", "train/distill_kl_p99",
                      "train/distill_teacher_logprob"]),
}
# series of another unit than the others of their plot, on a right-hand axis of their own (its label here): on one
# axis a share in 0..1 beside completion lengths of hundreds of tokens, or a run's cumulative count of drops beside
# the buffer's depth, was a flat line along the bottom
RIGHT_AXIS = {"train/truncated_fraction": "share of completions truncated",
              "train/groups_dropped_stale": "groups dropped as stale (cumulative)"}
CONSTANT_BECAUSE = {
    "train/ratio_max": "one optimizer step per batch (algo.num_iterations=1, algo.minibatches=1): the new/old ratio "
                       "is 1 by construction",
    "train/ratio_min": "as ratio_max",
    "train/clip_fraction": "the ratio is 1, so nothing is clipped",
    "train/clip_fraction_low": "as clip_fraction",
    "train/clip_fraction_high": "as clip_fraction",
    "train/ppo_kl": "the ratio is 1, so the policy has not moved within a step",
    "train/staleness_max": "every group was within trainer.max_staleness and it was reached every step",
    "train/truncated_fraction": "no completion reached generation.max_new_tokens, or every one did",
    "train/is_weight_min": "the importance weights were never below their floor",
    "train/groups_dropped_stale": "the count of groups dropped as too stale did not change during RL (with "
                                  "sampler.admission, samplers start only groups the trainer can use in time)",
    "train/is_truncated_fraction": "no token's importance ratio exceeded algo.tis_cap (or truncation is off)",
    "train/mixed_version_groups": "versions mix within a group only with sampler.weight_updates=in_flight",
    "train/mixed_version_tokens_lag*": "no group mixed versions (sampler.weight_updates=drain), or every "
                                       "mixed one had this share",
    "train/staleness_tokens_lag*": "no trained token was ever drawn at this lag (with sampler.admission the "
                                   "samplers may keep every group under trainer.max_staleness), or every one was",
}


def _expand(keys: list[str], rows: list[dict]) -> list[str]:
    """`keys` with each "prefix*" replaced by the logged keys it prefixes, by their numeric suffix."""
    out = []
    for key in keys:
        if not key.endswith("*"):
            out.append(key)
            continue
        found = {k for r in rows for k in r if k.startswith(key[:-1])}
        out += sorted(found, key=lambda k: (len(k), k))  # lag2 before lag10
    return out


def why_constant(key: str) -> str | None:
    """The reason CONSTANT_BECAUSE gives for `key`, exactly or by a "prefix*" entry."""
    if key in CONSTANT_BECAUSE:
        return CONSTANT_BECAUSE[key]
    return next((why for pattern, why in CONSTANT_BECAUSE.items()
                 if pattern.endswith("*") and key.startswith(pattern[:-1])), None)


def since_start(summary: dict) -> str:
    """A label for the figures a resumed trainer counts from its own start only (summary.json
    `figures_since_this_start`): after a resume they are not the whole run's."""
    resumed = summary.get("resumed_from")
    return f" (since the resume at step {resumed.get('step', '?')})" if isinstance(resumed, dict) else ""


def _fmt(value) -> str:
    """Numbers people read: 3 decimals for fractions, fewer digits for large values, ints as ints."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.3f}"
    return str(value)


def read_metrics(path: pathlib.Path) -> list[dict]:
    """Every row of a metrics JSONL file. A line that is not a JSON object is skipped with a warning naming it: a
    kill mid-write leaves a torn last line, and a resumed trainer appends its rows after it."""
    rows = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            row, why = None, f"not JSON ({exc})"
        else:
            why = "not a JSON object with an integer step"
        if not (isinstance(row, dict) and _is_step(row.get("step"))):
            print(f"grpo-stream report: warning: {path}:{number}: {why} (a line torn by a kill mid-write?); "
                  "skipped", file=sys.stderr)
            continue
        rows.append(row)
    return rows


def _is_step(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    """A figure that can be plotted: the trainer writes a NaN or infinite one as null (trainer_service/reports/
    files.py), and a damaged row may hold anything."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def json_object(path: pathlib.Path) -> tuple[dict, str | None]:
    """(the JSON object in `path`, None), ({}, None) when there is no file, or ({}, why) when the file holds no JSON
    object (cut short by a kill, damaged): a run file's reader names it instead of stopping on it."""
    if not path.exists():
        return {}, None
    try:
        doc = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as exc:
        return {}, f"not JSON ({exc})"
    return (doc, None) if isinstance(doc, dict) else ({}, "not a JSON object")


def read_summary(path: pathlib.Path) -> dict:
    """summary.json as a dict, or {} with a warning naming it when it is missing a JSON object (damaged, or cut
    short): the report is still made from the metrics."""
    summary, why = json_object(path)
    if why:
        print(f"grpo-stream report: warning: {path}: {why}; the report leaves out the run's summary figures",
              file=sys.stderr)
    return summary


def latest_timeline(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the RL steps' rows, the held-out evaluations' rows) of the run's final timeline, each one per step in step
    order. A resumed trainer appends to metrics-trainer.jsonl and logs again the steps after its checkpoint: the first
    step it logs again (a step at or below the last one logged) rolls back every row of that step and after, of
    both kinds, written before it, also those the resumed trainer has not reached yet (their weights are no longer
    the run's); an evaluation logged at or below the last evaluated step does the same for the evaluations."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for row in rows:
        step = row["step"]
        if "train/loss" in row:
            if train and step <= next(reversed(train)):
                _drop_from(train, step)
                _drop_from(evals, step)
            train[step] = row
        elif "eval/accuracy" in row:
            _drop_from(evals, step)
            evals[step] = row
    return list(train.values()), list(evals.values())


def _drop_from(by_step: dict[int, dict], step: int) -> None:
    """Remove the rows of `step` and after from `by_step` (its keys ascend, in insertion order)."""
    while by_step and next(reversed(by_step)) >= step:
        by_step.popitem()


def load_rows(run_dir: pathlib.Path, rows: list[dict] | None = None) -> list[dict]:
    """The RL steps' rows of the final timeline (latest_timeline; `rows`: metrics-trainer.jsonl's, read here when
    not given)."""
    path = run_dir / "metrics-trainer.jsonl"
    if rows is None:
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: RUN_DIR must be a directory written by `grpo-stream up` or "
                                    "`grpo-stream trainer --run-dir`")
        rows = read_metrics(path)
    return latest_timeline(rows)[0]


def load_eval_rows(run_dir: pathlib.Path, rows: list[dict] | None = None) -> list[dict]:
    """The held-out evaluations logged (eval/*) of the final timeline, one per step in step order (latest_timeline):
    a resumed run that evaluated a step again keeps the later row."""
    path = run_dir / "metrics-trainer.jsonl"
    if rows is None:
        rows = read_metrics(path) if path.exists() else []
    return latest_timeline(rows)[1]


def eval_table(rows: list[dict]) -> list[str]:
    """report.md's held-out curve: one line per evaluation, a column per figure logged (greedy accuracy, pass@k,
    maj@k, the task's own figures, reward)."""
    sampled = ("eval/pass_at_", "eval/maj_at_")
    figures = ["eval/accuracy", *sorted({k for r in rows for k in r if k.startswith(sampled)}, key=_by_k),
               *sorted({k for r in rows for k in r if k.startswith("eval/task/")}), "eval/reward"]
    names = {"eval/accuracy": "greedy accuracy"}
    lines = ["| step (version) | " + " | ".join(names.get(f, f.removeprefix("eval/").removeprefix("task/")
                                                          .replace("_at_", "@"))
                                               for f in figures) + " |",
             "|---|" + "---|" * len(figures)]
    return lines + [f"| {r['step']} | " + " | ".join(_fmt(r.get(f)) for f in figures) + " |" for r in rows]


def _by_k(key: str) -> tuple:
    """maj@k before pass@k, each by its k as a number: pass@2 before pass@16 (a string sort put 16 first)."""
    name, _, k = key.rpartition("_")
    return (name, int(k)) if k.isdigit() else (name, 0, k)


def eval_section(rows: list[dict], summary: dict) -> list[str]:
    """report.md's lines on the held-out evaluations: the table, and what was skipped or failed."""
    if not rows:
        return []
    lines = ["Held-out evaluation (eval_before at step 0, every eval.every_steps during RL, eval_after at the end):",
             "", *eval_table(rows), ""]
    if summary.get("eval_skipped") or summary.get("eval_errors"):
        lines += [f"Evaluations skipped (a newer version came due while they waited): {summary.get('eval_skipped')}; "
                  f"failed: {summary.get('eval_errors')}.", ""]
    return lines


def _plot_evals(plt, rows: list[dict], out: pathlib.Path) -> str | None:
    """heldout.png: every eval/* figure that is a share (accuracy, pass@k, maj@k, the task's) against the step."""
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k.startswith("eval/")
            and k.split("/")[1] not in ("version", "seconds", "num_problems", "errors", "skipped", "failed_episodes")
            and all(_number(r[k]) and 0.0 <= r[k] <= 1.0 for r in rows if k in r and r[k] is not None)
            and any(_number(r.get(k)) for r in rows)]
    if not keys:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if _number(r.get(key))]
        ax.plot(*zip(*points), marker="o", linewidth=1.4, label=key.removeprefix("eval/"))
    ax.set_title("Held-out evaluation")
    ax.set_xlabel("RL step (the version evaluated)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "heldout.png", dpi=100)
    plt.close(fig)
    return "heldout.png"


def _smooth(values, window: int = 20) -> list[float]:
    """Trailing moving average, so trends show through per-step noise."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _plot_series(plt, title: str, series: dict[str, list], path: pathlib.Path) -> None:
    """One plot of `series` (key -> (step, value) points) against the RL step, each raw and smoothed; a RIGHT_AXIS
    series beside others on a right-hand axis of its own, so each unit has a scale it can be read on."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    right, handles = None, []
    for number, (key, points) in enumerate(series.items()):
        axis, label = ax, key.removeprefix("train/")
        if key in RIGHT_AXIS and len(series) > 1:
            if right is None:
                right = ax.twinx()
                right.set_ylabel(RIGHT_AXIS[key], fontsize=8)
            axis, label = right, f"{label} (right axis)"
        xs, ys = zip(*points)
        color = f"C{number}"  # one cycle over both axes: a twin axis would restart it and repeat the first colour
        axis.plot(xs, ys, color=color, linewidth=0.8, alpha=0.35)
        handles += axis.plot(xs, _smooth(ys), color=color, linewidth=1.6, label=label)
    ax.set_title(title)
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
    (right or ax).legend(handles=handles, loc="best", fontsize=8)  # on the axis drawn last, so no line covers it
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary_table(summary: dict) -> list[str]:
    """The report's table of the run's figures from summary.json (none without one)."""
    if not summary:
        return []
    before = (summary.get("eval_before") or {}).get("accuracy")
    after = (summary.get("eval_after") or {}).get("accuracy")
    pass1_before = ((summary.get("eval_before") or {}).get("pass_at_k") or {}).get("1")  # with eval.samples
    pass1_after = ((summary.get("eval_after") or {}).get("pass_at_k") or {}).get("1")
    return [
        "| figure | value |", "|---|---|",
        f"| RL steps | {_fmt(summary.get('steps'))} |",
        f"| held-out greedy accuracy before → after | {_fmt(before)} → {_fmt(after)} |",
        *([f"| held-out sampled pass@1 before → after | {_fmt(pass1_before)} → {_fmt(pass1_after)} |"]
          if pass1_before is not None or pass1_after is not None else []),  # eval_before off: after's alone
        f"| groups ingested | {_fmt(summary.get('groups_ingested'))} |",
        # every term of the accounting identity (README): without invalid and duplicate drops the row did not add
        # up to groups ingested on a run that had them
        f"| trained / dropped stale / filtered / invalid / duplicate / left | {_fmt(summary.get('groups_trained'))} / "
        f"{_fmt(summary.get('groups_dropped_stale'))} / {_fmt(summary.get('groups_dropped_filtered'))} / "
        f"{_fmt(summary.get('groups_dropped_invalid'))} / {_fmt(summary.get('groups_dropped_duplicate'))} / "
        f"{_fmt(summary.get('groups_left_in_buffer'))} |",
        f"| weight versions published{since_start(summary)} | {_fmt(summary.get('weight_versions_published'))} |",
        f"| wall seconds{since_start(summary)} | {_fmt(summary.get('wall_seconds'))} |", ""]


def summary_mismatch(summary: dict, last_step: int) -> str | None:
    """Why the summary's figures are not of the last step logged, or None when they are (or there is no summary).
    The trainer writes summary.json when it ends: after a later trainer start, still running or failed (which
    writes none), the file holds the earlier start's figures, and the report showed them as the run's."""
    steps = summary.get("steps")
    if not _is_step(steps) or steps >= last_step:
        return None
    return (f"summary.json is of RL step {steps}, but the metrics go on to step {last_step}: it was written when an "
            "earlier trainer start ended, and the trainer started since (running, or failed) has not written its own "
            f"yet, so the figures above are of step {steps} (or a resume rolled back the steps after {steps}, and "
            "its trainer has not logged them again)")


def make_report(run_dir: pathlib.Path) -> pathlib.Path:
    import matplotlib  # noqa: PLC0415 - only this command needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    metrics = run_dir / "metrics-trainer.jsonl"
    logged = read_metrics(metrics) if metrics.exists() else None
    rows = load_rows(run_dir, logged)
    if not rows:
        raise ValueError(f"{run_dir}: no RL steps logged yet")
    out = run_dir / "report"
    out.mkdir(exist_ok=True)
    steps = [r["step"] for r in rows]
    images, index, constant = [], {}, {}
    for name, (title, keys) in PLOTS.items():
        series = {}
        for key in _expand(keys, rows):
            points = [(s, r[key]) for s, r in zip(steps, rows) if _number(r.get(key))]
            if not points:
                continue
            ys = [y for _, y in points]
            if max(ys) == min(ys):
                constant[key] = ys[0]
                continue
            series[key] = points
        if not series:
            continue
        _plot_series(plt, title, series, out / f"{name}.png")
        images.append(f"{name}.png")
        index[name] = {key: {"points": len(points), "min": min(y for _, y in points), "max": max(y for _, y in points)}
                       for key, points in series.items()}
    evals = load_eval_rows(run_dir, logged)
    heldout = _plot_evals(plt, evals, out)
    if heldout:
        images.insert(0, heldout)
        index["heldout"] = {"steps": [r["step"] for r in evals]}
    write_atomic(out / "plots.json", to_json({"plots": index, "constant": {
        key: {"value": value, "why": why_constant(key)} for key, value in constant.items()}}, indent=2))
    summary = read_summary(run_dir / "summary.json")
    lines = [f"# Run report: {summary.get('run', run_dir.name)}", "", *summary_table(summary)]
    last = rows[-1]
    mismatch = summary_mismatch(summary, last["step"])
    if mismatch:
        print(f"grpo-stream report: warning: {mismatch}", file=sys.stderr)
        lines += [f"Note: {mismatch}.", ""]
    lines += [f"Last step ({last['step']}): reward {_fmt(last.get('train/reward_mean'))}, "
              f"accuracy {_fmt(last.get('train/accuracy'))}, staleness {_fmt(last.get('train/staleness_mean'))}.",
              ""]
    lines += eval_section(evals, summary)
    lines += [f"![{name}]({name})" for name in images]
    if constant:
        lines += ["", "Constant over the run (not plotted):", ""]
        lines += [f"- {key.removeprefix('train/')} = {_fmt(value)}" + (f": {why_constant(key)}"
                                                                      if why_constant(key) else "")
                  for key, value in constant.items()]
    write_atomic(out / "report.md", "\n".join(lines) + "\n")
    return out
