"""The supervised warm start (trainer_service/learning/warmstart.py): a stop ends it between steps, and its report
counts the steps it took."""

import pathlib
import threading

from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.learning.warmstart import warm_start

ROOT = pathlib.Path(__file__).resolve().parents[4]


def test_a_stopped_warm_start_reports_the_steps_it_took():
    cfg = load_config(ROOT / "configs/tiny_arith_smoke.yaml", ["warmstart.steps=10", "warmstart.batch_size=2"])
    task, tokenizer = build_task_and_tokenizer(cfg)
    model = build_policy(cfg, tokenizer.vocab_size, seed=1)
    stop, taken = threading.Event(), []

    def progress():  # called after every step: stop after the second
        taken.append(1)
        if len(taken) == 2:
            stop.set()

    _, report = warm_start(model, model.params, task, tokenizer, cfg, stop_event=stop, progress=progress)
    assert len(taken) == 2 and report["steps"] == 2, report
