"""The report of a warm start stopped between its loss reads (every 50 steps): its final_loss is the last step's
loss, not NaN (a stop before step 50) or an earlier step's (step 50's after a stop at step 70)."""

import math
import pathlib
import threading

from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.learning.warmstart import warm_start

ROOT = pathlib.Path(__file__).resolve().parents[4]


def test_a_warm_start_stopped_between_log_points_reports_its_last_loss():
    cfg = load_config(ROOT / "configs/tiny_arith_smoke.yaml", ["warmstart.steps=10", "warmstart.batch_size=2"])
    task, tokenizer = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tokenizer.vocab_size, seed=1)
    stop, taken = threading.Event(), []

    def progress():
        taken.append(1)
        if len(taken) == 3:
            stop.set()

    _, report = warm_start(model, model.params, task, tokenizer, cfg, stop_event=stop, progress=progress)
    assert report["steps"] == 3 and math.isfinite(report["final_loss"]) and report["final_loss"] > 0, report
