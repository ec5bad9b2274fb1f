"""Supervised warm start of the tiny model on (deliberately imperfect) demonstrations."""

from __future__ import annotations

import functools
import logging
import random
import time
from typing import Any

import jax
import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.model.policy import PolicyModel
from grpo_stream.common.model.sharding import host_copy
from grpo_stream.common.tasks.arith import ArithTask
from grpo_stream.common.model.tokenizer import TextTokenizer
from grpo_stream.trainer_service.learning.batching import layout
from grpo_stream.trainer_service.learning.rl_update import abstract_optimizer_state
from grpo_stream.trainer_service.learning.train_step import (init_optimizer_state, make_optimizer, make_sft_step,
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
        if len(prompt) > p:  # the sampler refuses such a prompt too; say which setting, not layout's shapes
            raise ValueError(f"warm start: a demonstration's prompt has {len(prompt)} tokens, more than "
                             f"generation.max_prompt_tokens={p}: raise generation.max_prompt_tokens (to at least "
                             f"{len(prompt)}; other prompts of the task may be longer)")
        completion, learn = demonstration_tokens(problem, tokenizer, drop, rng, cfg.warmstart.tool_prob)
        if len(completion) > c:  # cut, it would lose its stop token: the model would learn not to stop
            raise ValueError(f"warm start: a demonstration has {len(completion)} tokens, more than "
                             f"generation.max_new_tokens={c}: raise generation.max_new_tokens (to at least "
                             f"{len(completion)}; other demonstrations of the task may be longer)")
        tokens[i], valid[i] = layout(prompt, completion, p, c, tokenizer.pad_id)
        loss_mask[i, p - 1:p - 1 + len(completion)] = learn
    return tokens, valid, loss_mask


def demonstration_tokens(problem, tokenizer: TextTokenizer, drop: bool, rng: random.Random,
                         tool_prob: float) -> tuple[list[int], list[float]]:
    """A demonstration's completion ids and which of them are learned: every model turn ends with the stop token;
    a multi-turn demonstration's observation tokens (what the environment writes) are not learned."""
    if not hasattr(problem, "demonstration_segments"):
        ids = tokenizer.encode(problem.demonstration(drop_carry=drop)) + [tokenizer.eos_id]
        return ids, [1.0] * len(ids)
    ids, learn = [], []
    for text, by_model in problem.demonstration_segments(use_tool=rng.random() < tool_prob, drop_carry=drop):
        part = tokenizer.encode(text) + ([tokenizer.eos_id] if by_model else [])
        ids += part
        learn += [float(by_model)] * len(part)
    return ids, learn


def placements(optimizer, params: Any, master: bool) -> tuple | None:
    """(params', optimizer state's, replicated) shardings on the mesh `params` live on, or None off a mesh."""
    sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        return None
    init = functools.partial(init_optimizer_state, optimizer, master=master)
    opt_like = abstract_optimizer_state(init, params, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, opt_like), replicated)


def warm_start(model: PolicyModel, params: Any, task: ArithTask, tokenizer: TextTokenizer, cfg: RunConfig,
               metrics=None, stop_event=None, progress=None) -> tuple[Any, dict]:
    """Run cfg.warmstart.steps supervised steps from `params` (fewer if `stop_event` is set); return params, report.
    `progress`: called after every step (a heartbeat)."""
    ws = cfg.warmstart
    optimizer = make_optimizer(ws.learning_rate, cfg.trainer.max_grad_norm)
    master = uses_master_weights(params, cfg.trainer.optimizer.state_dtype)
    opt_state = init_optimizer_state(optimizer, params, master)
    placed = placements(optimizer, params, master)
    if placed is not None:  # a mesh: every input and output on it, as every trainer process sees it
        opt_state = jax.device_put(opt_state, placed[1])
    step_fn = make_sft_step(model, optimizer, tokenizer.pad_id, master, out_shardings=placed)
    rng = random.Random(f"{cfg.run.seed}/warmstart")
    start, loss = time.time(), float("nan")
    # steps taken: the report's count (a stop before step k leaves k - 1); `read`: the step whose loss `loss` is
    done = read = 0
    for step in range(1, ws.steps + 1):
        if stop_event is not None and stop_event.is_set():
            log.warning("warm start interrupted after %d of %d steps", done, ws.steps)
            break
        batch = demonstration_batch(task, tokenizer, cfg, rng, first_index=10_000_000 + step * ws.batch_size)
        if placed is not None:
            batch = jax.device_put(batch, placed[2])
        params, opt_state, loss_arr = step_fn(params, opt_state, *batch)
        done = step
        if progress is not None:
            progress()
        if step % 50 == 0 or step == ws.steps:
            # a multi-process trainer's loss lives on one process's device: every process gathers it (host_copy is
            # a collective there, reached by all of them at the same step)
            loss, read = float(host_copy(loss_arr)), step
            log.info("warm start %d/%d  loss %.4f  (%.0fs)", step, ws.steps, loss, time.time() - start)
            if metrics is not None:
                metrics.scalars(step, {"loss": loss}, prefix="warmstart/")
    if done > read:  # stopped between log points: the report's final loss is the last step's (not NaN, or step
        # 50's after a stop at 70). Only a one-process trainer stops early (several run every step in lockstep), so
        # this read is no collective some process would not reach
        loss = float(host_copy(loss_arr))
    return params, {"steps": done, "final_loss": loss, "seconds": round(time.time() - start, 2),
                    "carry_drop_prob": ws.carry_drop_prob, "tool_prob": ws.tool_prob}
