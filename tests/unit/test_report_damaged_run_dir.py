"""`grpo-stream report` and the smoke result on run directories a crash or a diverged run leaves: a NaN figure the
trainer wrote as null, a row missing figures, a damaged summary.json, a row whose step is not a number. Each gives a
report (with a warning naming the file) instead of a TypeError or a bare JSONDecodeError."""

import json
import math

from grpo_stream.reports import smoke
from grpo_stream.reports.run_report import make_report, read_metrics
from grpo_stream.trainer_service.reports.metrics import JsonlTracker


def row(step: int, **figures) -> dict:
    base = {"train/loss": 0.1 * step, "train/reward_mean": 0.1 * step, "train/accuracy": 0.5,
            "train/staleness_mean": 1.0, "train/grad_norm": 1.0 + step}
    return {"step": step, **base, **figures}


def test_a_nan_figure_written_as_null_is_left_out_of_the_plots_not_a_crash(tmp_path):
    """A diverged step: the trainer writes NaN as null (files.to_json); max() over None and a float failed."""
    tracker = JsonlTracker(tmp_path / "metrics-trainer.jsonl")
    for step in range(1, 5):
        figures = {k.removeprefix("train/"): v for k, v in row(step).items() if k != "step"}
        if step == 4:
            figures.update(loss=math.nan, grad_norm=math.nan, reward_mean=math.inf)
        tracker.scalars(step, figures, prefix="train/")
    tracker.scalars(0, {"accuracy": math.nan, "reward": 0.3}, prefix="eval/")
    tracker.scalars(4, {"accuracy": 0.4, "reward": 0.3}, prefix="eval/")
    tracker.close()
    out = make_report(tmp_path)
    text = (out / "report.md").read_text()
    assert "Last step (4): reward None, accuracy 0.500" in text
    plots = json.loads((out / "plots.json").read_text())["plots"]
    assert plots["update"]["train/grad_norm"]["points"] == 3  # the null step is not a point
    assert plots["heldout"]["steps"] == [0, 4]


def test_a_row_missing_figures_and_a_damaged_summary_still_give_a_report(tmp_path, capsys):
    (tmp_path / "metrics-trainer.jsonl").write_text(
        json.dumps(row(1)) + "\n" + json.dumps({"step": 2, "train/loss": 0.3}) + "\n"
        + json.dumps({"step": "3", "train/loss": 0.2}) + "\n")
    (tmp_path / "summary.json").write_text('{"run": "x", "ste')
    out = make_report(tmp_path)
    assert "Last step (2): reward None, accuracy None, staleness None." in (out / "report.md").read_text()
    err = capsys.readouterr().err
    assert f"{tmp_path / 'summary.json'}: not JSON" in err
    assert f"{tmp_path / 'metrics-trainer.jsonl'}:3: not a JSON object with an integer step" in err
    assert [r["step"] for r in read_metrics(tmp_path / "metrics-trainer.jsonl")] == [1, 2]
    (tmp_path / "summary.json").write_text("[1, 2]")
    make_report(tmp_path)
    assert f"{tmp_path / 'summary.json'}: not a JSON object" in capsys.readouterr().err


def smoke_dir(tmp_path, summary: str | None, sampler: str | None = None):
    (tmp_path / "config.yaml").write_text("trainer: {steps: 2}\nsampler: {engine: vllm, weight_updates: drain}\n"
                                          "model: {path: m}\n")
    if summary is not None:
        (tmp_path / "summary.json").write_text(summary)
    if sampler is not None:
        (tmp_path / "sampler-0.json").write_text(sampler)
    return tmp_path


def test_smoke_result_with_a_nan_agreement_fails_its_check_instead_of_crashing(tmp_path):
    """The trainer writes a NaN mean agreement as null: `None <= 0.05` raised, and the result a TPU user should send
    back was never written."""
    run = smoke_dir(tmp_path, json.dumps({"steps": 2, "groups_dropped_invalid": 0,
                                          "logprob_agreement_lag0": {"tokens": 10, "mean_abs": None}}),
                    json.dumps({"versions": [1, 2]}))
    result = smoke.report(run, [])
    assert result["checks"]["logprob_agreement_lag0_mean_abs"]["ok"] is False
    assert result["checks"]["final_version_installed"]["ok"] is True and result["passed"] is False


def test_smoke_result_of_damaged_files_names_them_and_fails(tmp_path, capsys):
    run = smoke_dir(tmp_path, '{"steps": 2, "groups_dro', '{"versions": [1,')
    out = tmp_path / "smoke.json"
    assert smoke.main([str(run), "--python", "/nonexistent/python", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["passed"] is False and not result["checks"]["trainer_steps"]["ok"]
    assert {d.split(":")[0] for d in result["damaged"]} == {str(run / "summary.json"), str(run / "sampler-0.json")}
    (run / "config.yaml").write_text("trainer: [")
    assert smoke.main([str(run)]) == 2
    assert "config.yaml" in capsys.readouterr().err
