"""What `up` says last when a stop signal ended the run (grpo_stream/up/summary.py): where and how to resume. A Ctrl-C
once the trainer ran ended on "[up] done in ...: 131 steps" with nothing more, and the trainer's own line said to
"start the trainer again"; `up` started without --run-dir makes a new directory each time, so the same command
started a new run instead of resuming."""

from __future__ import annotations

import json

from grpo_stream.common.config.loading import load_config
from grpo_stream.up.summary import RunEnd, RunSummary
from grpo_stream.up.supervise import Outcome


def finish(run_dir, outcome: Outcome, trainer_summary: dict):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(trainer_summary))
    end = RunEnd(outcome, 0, {"sampler-0": 0}, {"trainer": 0, "sampler-0": 0}, run_dir / "logs" / "trainer.log")
    return RunSummary(load_config(None, ["trainer.steps=200"]), run_dir, started=0.0).finish(end)


SUMMARY = {"wall_seconds": 12.0, "steps": 131, "stopped_early": True, "groups_ingested": 10, "groups_trained": 8,
           "groups_dropped_stale": 1, "groups_dropped_invalid": 0, "groups_dropped_filtered": 0,
           "groups_dropped_duplicate": 0, "groups_left_in_buffer": 1, "resumed_from": None}


def test_a_run_stopped_by_a_signal_says_last_where_it_stopped_and_how_to_resume(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "tiny arith-20261201-084416"
    assert finish(run_dir, Outcome("interrupted"), SUMMARY) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("grpo-stream up: stopped by a signal at step 131 of 200; ")
    assert f"--run-dir '{run_dir}'" in err[-1]  # quoted: a directory with a space


def test_a_run_that_trained_every_step_before_the_signal_has_nothing_to_resume(tmp_path, capsys):
    assert finish(tmp_path, Outcome("interrupted"), {**SUMMARY, "steps": 200, "stopped_early": False}) == 130
    assert "resume" not in capsys.readouterr().err


def test_the_last_line_of_a_stopped_run_says_stopped_and_no_eval_after(tmp_path, capsys):
    """It read "[up] done in 24s: 11 steps ... held-out ... 0.000 -> None" after a Ctrl-C: neither done, nor an
    evaluation after."""
    before = {"accuracy": 0.25, "reward": 0.3, "reward_weights": {"answer_correct": 1.0}}
    assert finish(tmp_path, Outcome("interrupted"), {**SUMMARY, "eval_before": before, "eval_after": None}) == 130
    out = capsys.readouterr().out
    assert out.startswith("[up] stopped after ") and "s: 131 steps" in out and "None" not in out
    assert "greedy accuracy 0.250 before RL, none after (no eval_after)" in out
