"""The run's output files as a reader meets them: strict JSON (a NaN figure is null, never bare NaN), written whole,
a torn metrics line skipped with its place named, and the figures a resumed trainer counts from its own start
labelled as such."""

import json
import math
import os
import types

import numpy as np
import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.reports.run_report import make_report, read_metrics
from grpo_stream.common.runtime.files import to_json
from grpo_stream.trainer_service.reports.metrics import JsonlTracker
from grpo_stream.trainer_service.reports.run_outputs import write_summary

COUNTERS = {"ingested": 8, "trained": 8, "dropped_stale": 0, "dropped_invalid": 0, "dropped_filtered": 0,
            "dropped_duplicate": 0, "refused_invalid": 0, "refused_duplicate": 0, "refused_full": 0, "depth": 0}


def strict(text: str):
    """json.loads as a strict reader (jq, JavaScript) parses: NaN / Infinity are errors."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def summary_of(tmp_path, resumed_from=None, warmstart=None, installed=None) -> dict:
    samplers = types.SimpleNamespace(groups_generated=lambda: 8, installed={} if installed is None else installed)
    publisher = types.SimpleNamespace(samplers=samplers, published=[5, 6], publish_seconds=[0.1])
    durability = types.SimpleNamespace(epoch="e1", checkpointed=[6], held=lambda: 0)
    return write_summary(tmp_path / "summary.json", load_config(None, []), steps=6, counters=COUNTERS, by_sampler={},
                         publisher=publisher, durability=durability,
                         agreement={"tokens": 3, "abs_sum": math.nan, "max_abs": math.inf}, mesh_shape={},
                         final_weights=None, carried={"warmstart": warmstart, "eval_before": None}, eval_after=None,
                         rl_seconds=1.0, started=0.0, resumed_from=resumed_from, trained_here=8)


def test_non_finite_figures_are_written_as_null_in_the_metrics_and_summary(tmp_path):
    tracker = JsonlTracker(tmp_path / "metrics-trainer.jsonl")
    tracker.scalars(1, {"loss": math.nan, "ratio_max": math.inf, "reward_mean": 0.5}, prefix="train/")
    tracker.close()
    row = strict((tmp_path / "metrics-trainer.jsonl").read_text())
    assert (row["train/loss"], row["train/ratio_max"], row["train/reward_mean"]) == (None, None, 0.5)
    summary_of(tmp_path, warmstart={"steps": 3, "final_loss": math.nan})
    written = strict((tmp_path / "summary.json").read_text())
    assert written["logprob_agreement_lag0"] == {"tokens": 3, "mean_abs": None, "max_abs": None}
    assert written["warmstart"]["final_loss"] is None


def test_numpy_figures_other_than_float64_are_written_as_python_numbers():
    """json refuses numpy's float32, int64, bool_ and arrays: a task's figure or an evaluation's count of one of those
    types would otherwise fail summary.json at the end of the run."""
    doc = {"eval": {"task": np.float32(0.25), "n": np.int64(3), "ok": np.bool_(True), "bad": np.float32("nan")},
           "ids": np.array([1, 2], dtype=np.int32)}
    assert strict(to_json(doc)) == {"eval": {"task": 0.25, "n": 3, "ok": True, "bad": None}, "ids": [1, 2]}

class _Reporting(dict):
    """SamplerRegistry.installed as the weight service's threads change it: a sampler reports while it is read."""

    def items(self):
        for item in super().items():
            yield item
            self[f"sampler-{len(self)}"] = [1]  # the next item: "dictionary changed size during iteration"


def test_a_sampler_reporting_while_the_summary_is_written_does_not_fail_it(tmp_path):
    installed = _Reporting({"sampler-0": [0, 2]})
    summary = summary_of(tmp_path, installed=installed)
    assert strict((tmp_path / "summary.json").read_text())["sampler_weight_versions"] == {"sampler-0": [0, 2]}
    installed["sampler-0"].append(4)  # the summary holds a copy
    assert summary["sampler_weight_versions"] == {"sampler-0": [0, 2]}

def test_a_resumed_run_labels_the_figures_counted_since_its_start(tmp_path):
    summary = summary_of(tmp_path, resumed_from={"step": 4, "path": "ckpt/4"})
    assert {"weight_versions_published", "wall_seconds", "checkpoints_saved", "rl_seconds", "groups_generated",
            "logprob_agreement_lag0"} <= set(summary["figures_since_this_start"])
    rows = [{"step": s, "train/loss": 0.1 * s, "train/reward_mean": 0.1, "train/accuracy": 0.5,
             "train/staleness_mean": 1.0} for s in range(1, 7)]
    (tmp_path / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = (make_report(tmp_path) / "report.md").read_text()
    assert "| weight versions published (since the resume at step 4) | 2 |" in report
    assert "| wall seconds (since the resume at step 4) |" in report


def test_a_torn_metrics_line_is_skipped_naming_its_file_and_line(tmp_path, capsys):
    """A kill mid-write leaves half a line; the resumed trainer appends after it. `report` failed on it with a bare
    JSONDecodeError naming neither file nor line."""
    rows = [json.dumps({"step": s, "train/loss": 0.1 * s, "train/reward_mean": 0.1 * s, "train/accuracy": 0.5,
                        "train/staleness_mean": 1.0}) for s in range(1, 5)]
    path = tmp_path / "metrics-trainer.jsonl"
    path.write_text("\n".join([rows[0], rows[1], rows[2][:20], rows[2], rows[3]]) + "\n")
    out = make_report(tmp_path)
    assert "Last step (4)" in (out / "report.md").read_text()
    strict((out / "plots.json").read_text())
    assert f"{path}:3: not JSON" in capsys.readouterr().err


def test_summary_and_report_are_replaced_whole_never_left_half_written(tmp_path, monkeypatch):
    """A kill or a full disk while summary.json / report.md were written left a truncated file where the last good
    one was: each is now written beside it and renamed into place (os.replace), so a failed write changes nothing."""
    (tmp_path / "summary.json").write_text('{"steps": 1}')
    rows = [{"step": s, "train/loss": 0.1 * s, "train/reward_mean": 0.1 * s, "train/accuracy": 0.5,
             "train/staleness_mean": 1.0} for s in range(1, 4)]
    (tmp_path / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.md").write_text("# the last good report\n")

    def cut_off(*_):
        raise OSError("No space left on device")
    monkeypatch.setattr(os, "replace", cut_off)
    with pytest.raises(OSError):
        summary_of(tmp_path)
    with pytest.raises(OSError):
        make_report(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 1}
    assert (tmp_path / "report" / "report.md").read_text() == "# the last good report\n"
    assert not [p for p in tmp_path.rglob("*.tmp")]  # no temporary file left behind


def test_a_row_written_after_a_torn_line_starts_a_line_of_its_own(tmp_path, capsys):
    """The resumed trainer's first row was appended onto the torn text of the killed one's last row, and the
    reader then skipped both: the new row was lost with the torn one."""
    path = tmp_path / "metrics-trainer.jsonl"
    path.write_text('{"step": 1, "train/loss": 0.5}\n{"step": 2, "train/lo')  # a kill mid-write
    tracker = JsonlTracker(path)
    tracker.scalars(3, {"loss": 0.25}, prefix="train/")
    tracker.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 3]
    assert f"{path}:2: not JSON" in capsys.readouterr().err


def test_a_write_that_fails_midway_does_not_swallow_the_next_row(tmp_path):
    """A full disk cuts a row short in this process: once space is back, the next row goes on a line of its own."""
    path = tmp_path / "metrics-trainer.jsonl"
    tracker = JsonlTracker(path)
    real = tracker._file

    class FullDisk:
        def write(self, data):
            real.write(data[:10])
            raise OSError(28, "No space left on device")
    tracker._file = FullDisk()
    with pytest.raises(OSError):
        tracker.scalars(1, {"loss": 1.0}, prefix="train/")
    tracker._file = real
    tracker.scalars(2, {"loss": 0.5}, prefix="train/")
    tracker.close()
    assert [r["step"] for r in read_metrics(path)] == [2]
