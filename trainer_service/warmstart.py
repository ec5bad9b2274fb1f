"""Supervised warm start of the tiny model on (deliberately imperfect) demonstrations."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.model.policy import PolicyModel
from grpo_stream.common.tasks.arith import ArithTask
from grpo_stream.common.model.tokenizer import TextTokenizer
from grpo_stream.trainer_service.batching import layout
from grpo_stream.trainer_service.train_step import (init_optimizer_state, make_optimizer, make_sft_step,
                                                   uses_master_weights)

log = logging.getLogger(__name__)


def demonstration_batch(task: ArithTask, tokenizer: TextTokenizer, cfg: RunConfig, rng: random.Random,
                        first_index: int):
    p, c = cfg.generation.max_prompt_tokens, cfg.generation.max_new_tokens
    size = cfg.warmstart.batch_size
    tokens = np.zeros((size, p + c), np.int32)
    valid = np.zeros((size, p + c), np.bool_)
    loss_mask = np.zeros((size, p + c - 1), np.float32)
    for i in range(size):
        problem = task.train_problem(first_index + i)
        drop = rng.random() < cfg.warmstart.carry_drop_prob
        prompt = tokenizer.encode(problem.prompt)
        completion = (tokenizer.encode(problem.demonstration(drop_carry=drop)) + [tokenizer.eos_id])[:c]
        tokens[i], valid[i] = layout(prompt, completion, p, c, tokenizer.pad_id)
        loss_mask[i, p - 1:p - 1 + len(completion)] = 1.0
    return tokens, valid, loss_mask


def warm_start(model: PolicyModel, params: Any, task: ArithTask, tokenizer: TextTokenizer, cfg: RunConfig,
               metrics=None, stop_event=None) -> tuple[Any, dict]:
    """Run cfg.warmstart.steps supervised steps from `params` (fewer if `stop_event` is set); return params, report."""
    ws = cfg.warmstart
    optimizer = make_optimizer(ws.learning_rate, cfg.trainer.max_grad_norm)
    master = uses_master_weights(params, cfg.trainer.optimizer.state_dtype)
    opt_state = init_optimizer_state(optimizer, params, master)
    step_fn = make_sft_step(model, optimizer, tokenizer.pad_id, master)
    rng = random.Random(f"{cfg.run.seed}/warmstart")
    start, loss = time.time(), float("nan")
    step = 0
    for step in range(1, ws.steps + 1):
        if stop_event is not None and stop_event.is_set():
            log.warning("warm start interrupted at step %d", step)
            break
        batch = demonstration_batch(task, tokenizer, cfg, rng, first_index=10_000_000 + step * ws.batch_size)
        params, opt_state, loss_arr = step_fn(params, opt_state, *batch)
        if step % 50 == 0 or step == ws.steps:
            loss = float(loss_arr)
            log.info("warm start %d/%d  loss %.4f  (%.0fs)", step, ws.steps, loss, time.time() - start)
            if metrics is not None:
                metrics.scalars(step, {"loss": loss}, prefix="warmstart/")
    return params, {"steps": step, "final_loss": loss, "seconds": round(time.time() - start, 2),
                    "carry_drop_prob": ws.carry_drop_prob}
