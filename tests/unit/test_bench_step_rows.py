"""The benchmarks' reading of a trainer's step rows (bench/async_vs_sync.step_rows, which gpu-check's figures use)."""

import json

from grpo_stream.bench.async_vs_sync import step_rows

ROW = {"train/staleness_mean": 0.0, "train/staleness_max": 0, "train/compute_seconds": 1.0, "train/wait_seconds": 0.5,
       "train/step_seconds": 2.0}


def test_a_resumed_trainers_steps_count_once_from_the_final_timeline(tmp_path):
    # steps 1-4, a kill, then a trainer resumed from step 2's checkpoint logs 3-6 again: 6 steps, not 8
    first = [{"step": k, "time": 100.0 + k, **ROW} for k in range(1, 5)]
    resumed = [{"step": k, "time": 200.0 + k, **ROW} for k in range(3, 7)]
    evaluation = {"step": 4, "eval/accuracy": 0.5}  # no step row: never counted
    lines = [json.dumps(r) for r in first + [evaluation] + resumed]
    (tmp_path / "metrics-trainer.jsonl").write_text("\n".join(lines) + "\n")
    rows = step_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["time"] for r in rows[2:]] == [203.0, 204.0, 205.0, 206.0]  # the resumed trainer's rows


def test_no_metrics_file_is_no_rows(tmp_path):
    assert step_rows(tmp_path) == []
