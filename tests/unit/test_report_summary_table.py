"""report.md's table of summary.json's figures: the group accounting adds up (every term of the identity), and a
summary.json an earlier trainer start left behind is named as such instead of shown as the run's."""

import json

from grpo_stream.reports.run_report import make_report, summary_table


def write_run(run_dir, steps: int, summary: dict | None) -> None:
    rows = [{"step": s, "train/loss": 0.1, "train/reward_mean": 0.1 * s, "train/accuracy": 0.5,
             "train/staleness_mean": 1.0} for s in range(1, steps + 1)]
    (run_dir / "metrics-trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))


def test_the_accounting_row_holds_every_term_so_it_adds_up_to_groups_ingested():
    """A sampler that sent broken groups and a second copy the trainer dropped: ingested 20 = 12 trained + 2 stale
    + 1 filtered + 3 invalid + 1 duplicate + 1 left. Without the invalid and duplicate drops the row summed to 16."""
    summary = {"steps": 3, "groups_ingested": 20, "groups_trained": 12, "groups_dropped_stale": 2,
               "groups_dropped_filtered": 1, "groups_dropped_invalid": 3, "groups_dropped_duplicate": 1,
               "groups_left_in_buffer": 1}
    (row,) = [line for line in summary_table(summary) if line.startswith("| trained")]
    header, values = (cell.strip() for cell in row.strip("|").split("|"))
    terms = dict(zip(header.split(" / "), (int(v) for v in values.split(" / "))))
    assert terms == {"trained": 12, "dropped stale": 2, "filtered": 1, "invalid": 3, "duplicate": 1, "left": 1}
    assert sum(terms.values()) == summary["groups_ingested"]


def test_a_summary_of_an_earlier_trainer_start_is_named_not_shown_as_the_runs(tmp_path, capsys):
    """A run stopped at step 4 (its summary.json written then), resumed, and failed at step 9 (the trainer writes
    no summary on a failure): the table's figures are step 4's, and report.md says so."""
    write_run(tmp_path, 9, {"run": "r", "steps": 4, "stopped_early": True, "resumed_from": None})
    report = (make_report(tmp_path) / "report.md").read_text()
    assert "| RL steps | 4 |" in report and "Last step (9)" in report
    assert "Note: summary.json is of RL step 4, but the metrics go on to step 9" in report, report
    assert "summary.json is of RL step 4" in capsys.readouterr().err


def test_a_summary_of_the_last_step_logged_gets_no_note(tmp_path, capsys):
    write_run(tmp_path, 6, {"run": "r", "steps": 6})
    assert "Note:" not in (make_report(tmp_path) / "report.md").read_text()
    write_run(tmp_path, 6, None)  # a first trainer start still running: no summary yet
    (tmp_path / "summary.json").unlink()
    assert "Note:" not in (make_report(tmp_path) / "report.md").read_text()
    assert "warning" not in capsys.readouterr().err
