"""`grpo-stream report`'s plot index on a synthetic run: per-lag series found by prefix, in numeric order, and
constant series listed with the reason a "prefix*" entry gives."""

import json

from grpo_stream.reports.run_report import PLOTS, _expand, make_report, why_constant


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
