"""The supervised warm start (trainer_service/learning/warmstart.py): a stop ends it between steps, and its report
counts the steps it took; a prompt or a demonstration too long for the layout names the setting."""

import pathlib
import random
import threading

import pytest

from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.config.loading import load_config
from grpo_stream.trainer_service.learning.warmstart import demonstration_batch, warm_start

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


def test_a_prompt_over_max_prompt_tokens_names_the_setting():
    # the smoke config's arith prompts run to about 22 tokens: 16 is too few for some of them
    cfg = load_config(ROOT / "configs/tiny_arith_smoke.yaml", ["generation.max_prompt_tokens=16"])
    task, tokenizer = build_task_and_tokenizer(cfg)
    with pytest.raises(ValueError, match=r"generation\.max_prompt_tokens=16: raise generation\.max_prompt_tokens"):
        demonstration_batch(task, tokenizer, cfg, random.Random(0), first_index=10_000_000)


def test_a_demonstration_over_max_new_tokens_names_the_setting():
    """It was cut to fit, losing its stop token: the warm start taught the model to run on to its budget."""
    cfg = load_config(ROOT / "configs/tiny_arith_smoke.yaml", ["generation.max_new_tokens=8"])
    task, tokenizer = build_task_and_tokenizer(cfg)
    with pytest.raises(ValueError, match=r"generation\.max_new_tokens=8: raise generation\.max_new_tokens"):
        demonstration_batch(task, tokenizer, cfg, random.Random(0), first_index=10_000_000)
