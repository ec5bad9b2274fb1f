"""`grpo-stream report`'s plot index on a synthetic run: per-lag series found by prefix, in numeric order, and
constant series listed with the reason a "prefix*" entry gives."""

import json
import pathlib

from grpo_stream.reports.run_report import PLOTS, _expand, load_eval_rows, load_rows, make_report, why_constant


def test_prefix_series_expand_in_numeric_order():
    rows = [{"train/staleness_tokens_lag10": 0.0, "train/staleness_tokens_lag2": 1.0, "train/x": 1},
            {"train/staleness_tokens_lag0": 0.0}]
    assert _expand(["train/x", "train/staleness_tokens_lag*"], rows) == [
        "train/x", "train/staleness_tokens_lag0", "train/staleness_tokens_lag2", "train/staleness_tokens_lag10"]
    assert why_constant("train/mixed_version_tokens_lag3").startswith("no group mixed versions")
    assert why_constant("train/ratio_max").startswith("one optimizer step")
    assert why_constant("train/nothing") is None


def test_health_plots_in_the_index(tmp_path):
    rows = []
    for step in range(1, 6):
        row = {"step": step, "train/loss": 0.1 * step, "train/reward_mean": 0.1 * step, "train/accuracy": 0.5,
               "train/staleness_mean": 1.0, "train/is_ess_group_mean": 1.0 - 0.05 * step,
               "train/mismatch_kl_k3": 0.001 * step, "train/is_ratio_p50": 1.0 + 0.01 * step,
               "train/staleness_tokens_lag0": 0.2 * step / 5, "train/staleness_tokens_lag1": 1 - 0.2 * step / 5,
               "train/staleness_tokens_lag2": 0.0, "train/mixed_version_groups": 0.0,
               **{f"train/mixed_version_tokens_lag{s}": 0.0 for s in range(3)}}
        rows.append(row)
    (tmp_path / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    index = json.loads((make_report(tmp_path) / "plots.json").read_text())
    assert set(index["plots"]["off_policy_health"]) == {"train/is_ess_group_mean", "train/mismatch_kl_k3",
                                                        "train/is_ratio_p50"}
    assert list(index["plots"]["staleness_by_version"]) == ["train/staleness_tokens_lag0",
                                                            "train/staleness_tokens_lag1"]
    assert "mixed_versions" not in index["plots"]  # nothing in it moved
    constant = index["constant"]
    assert {"train/staleness_tokens_lag2", "train/mixed_version_groups", "train/mixed_version_tokens_lag0"} <= set(
        constant)
    assert all(constant[key]["why"] for key in constant if key not in ("train/accuracy", "train/staleness_mean")), \
        constant
    assert "off_policy_health" in PLOTS and "staleness_by_version" in PLOTS


def test_held_out_curve_in_the_report_one_row_per_step(tmp_path):
    """eval/* rows (before at 0, during, after): plotted, tabulated in step order; a step evaluated again after a
    resume keeps its later row; the IFEval-like task figures get their own column."""
    rows = [{"step": s, "train/loss": 0.1, "train/reward_mean": 0.1 * s, "train/accuracy": 0.5,
             "train/staleness_mean": 1.0} for s in range(1, 7)]
    # from step 2 again: a resumed run's replay (its checkpoint at step 1), which evaluates step 4 again too
    evals = [(0, 0.10), (2, 0.20), (4, 0.25), (2, 0.22), (4, 0.30), (6, 0.40)]
    rows += [{"step": s, "eval/version": s, "eval/accuracy": a, "eval/pass_at_1": a / 2, "eval/maj_at_4": a,
              "eval/task/prompt_level_strict_acc": a / 3, "eval/reward": a, "eval/seconds": 12.0} for s, a in evals]
    (tmp_path / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"run": "r", "steps": 6, "eval_skipped": [8], "eval_errors": 1}))
    out = make_report(tmp_path)
    assert json.loads((out / "plots.json").read_text())["plots"]["heldout"] == {"steps": [0, 2, 4, 6]}
    report = (out / "report.md").read_text()
    assert ("| step (version) | greedy accuracy | maj@4 | pass@1 | prompt_level_strict_acc | reward |"
            in report), report
    assert "| 2 | 0.220 | 0.220 | 0.110 | 0.073 | 0.220 |" in report and "| 2 | 0.200 |" not in report
    table = [line for line in report.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert [int(line.split("|")[1]) for line in table] == [0, 2, 4, 6]
    assert "skipped (a newer version came due while they waited): [8]; failed: 1" in report
    assert (out / "heldout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_training_curves_have_one_point_per_step_after_a_resume(tmp_path):
    """A resumed trainer logs again the steps after its checkpoint (metrics-trainer.jsonl is appended to): the curves
    keep the later row of each step, in step order, instead of running backwards."""
    losses = [(1, 0.9), (2, 0.8), (3, 0.7), (4, 0.6), (3, 0.65), (4, 0.55), (5, 0.5)]  # resumed from step 2
    rows = [{"step": s, "train/loss": loss, "train/reward_mean": 1 - loss, "train/accuracy": 0.5,
             "train/staleness_mean": 1.0} for s, loss in losses]
    (tmp_path / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["step"], r["train/loss"]) for r in load_rows(tmp_path)] == [(1, 0.9), (2, 0.8), (3, 0.65), (4, 0.55),
                                                                         (5, 0.5)]


def test_a_resume_rolls_back_the_rows_of_steps_it_has_not_logged_again_yet(tmp_path):
    """A trainer that reached step 8 and crashed, resumed from its checkpoint at step 5 and now at step 7: the first
    timeline's step 8 (and its evaluation) are no longer the run's, so the curves, the held-out table and the last
    step of report.md end at step 7 instead of showing the rolled-back step."""
    steps = [(s, 0.1 * s) for s in range(1, 9)] + [(6, 0.66), (7, 0.77)]
    rows = [{"step": s, "train/loss": 1.0 - r, "train/reward_mean": r, "train/accuracy": 0.5,
             "train/staleness_mean": 1.0} for s, r in steps]
    rows.insert(4, {"step": 4, "eval/version": 4, "eval/accuracy": 0.4})
    rows.insert(9, {"step": 8, "eval/version": 8, "eval/accuracy": 0.8})
    (tmp_path / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [(r["step"], r["train/reward_mean"]) for r in load_rows(tmp_path)][-3:] == [(5, 0.5), (6, 0.66), (7, 0.77)]
    assert [r["step"] for r in load_eval_rows(tmp_path)] == [4]
    report = (make_report(tmp_path) / "report.md").read_text()
    assert "Last step (7): reward 0.770" in report and "| 8 |" not in report, report


def test_a_share_beside_lengths_in_tokens_gets_a_scale_it_can_be_read_on(tmp_path, monkeypatch):
    """lengths.png: truncated_fraction (0..1) shared one axis with response_length_mean (hundreds of tokens), so it
    was drawn as a flat line along the bottom; buffer.png the same for the buffer's depth beside the run's cumulative
    stale drops. Each such series has a right-hand axis of its own."""
    from matplotlib.figure import Figure

    saved = {}

    def savefig(fig, path, **kwargs):  # each saved plot's axes: (y range, the labels of the lines drawn on it)
        saved[pathlib.Path(path).name] = [(ax.get_ylim(), {line.get_label() for line in ax.get_lines()})
                                          for ax in fig.axes]

    monkeypatch.setattr(Figure, "savefig", savefig)
    rows = [{"step": s, "train/loss": 0.1, "train/reward_mean": 0.1 * s, "train/accuracy": 0.5,
             "train/staleness_mean": 1.0, "train/response_length_mean": 200.0 + 10 * s,
             "train/truncated_fraction": 0.02 * s, "train/buffer_depth": float(s % 3),
             "train/groups_dropped_stale": 400.0 * s} for s in range(1, 9)]
    (tmp_path / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_report(tmp_path)

    def axis_of(plot: str, label: str) -> tuple[float, float]:
        return next(ylim for ylim, labels in saved[plot] if any(name.startswith(label) for name in labels))

    assert axis_of("lengths.png", "truncated_fraction")[1] < 1 < 200 < axis_of("lengths.png", "response_length")[1]
    assert axis_of("buffer.png", "buffer_depth")[1] < 10 < 400 < axis_of("buffer.png", "groups_dropped_stale")[1]
