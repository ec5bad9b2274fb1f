"""`grpo-stream plan`: the trainer's held-out evaluation on the trainer's own devices (eval_before, eval_after,
eval.every_steps, weights.verify_prompts). The trainer evaluates with a JAX engine built on its policy
(trainer_service/model_parts.py, whatever sampler.engine is), so beside its resident state a trainer device holds the
weights in decode layout and a KV cache for the evaluation's rows; on the trainer mesh that cache is split over tp
only, whole on every fsdp device (slot_programs.py: the slot state's layout). During RL (eval.every_steps) the
evaluation runs while the steps go on, on copies of the plain weights: one running, at most one waiting
(trainer_service/reports/in_run_eval.py)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.engine import continuous
from grpo_stream.plan.host_memory import evaluation_rows

IN_RUN_COPIES = 2  # the version evaluated and the one waiting (in_run_eval.py)


def shard_bytes(tree: Any) -> int:
    """Bytes one device holds of the abstract arrays in `tree` (the largest shard, for uneven splits)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def evaluation_report(cfg: RunConfig, model) -> dict[str, int] | None:
    """Per trainer device: the evaluation engine's decode weights, its KV cache for the evaluation's rows, and the
    copies of the plain weights it evaluates (a LoRA run's merged copy; during RL the in-run copies); `during_rl`:
    whether it runs beside the update steps. None: the trainer never evaluates. `model`: the policy as abstract
    arrays on the trainer mesh (the base model with LoRA: its merged weights have the base's shapes)."""
    rows = evaluation_rows(cfg)
    if not rows:
        return None
    engine = continuous.ContinuousEngine(model, 0, 1, **continuous.engine_settings(cfg))
    relayout = engine.device.relayout.lower(model.params).compile()
    weights = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh),
                           jax.eval_shape(engine.device.relayout, model.params), relayout.output_shardings)
    engine.device.use_mesh(weights)  # the slot state laid out as the engine lays it out on this mesh
    slots, window = engine.table.size_for(rows), engine.cache_len
    empty = engine.device.empty.lower(size=slots, window=window).compile()
    kv = jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh),
                      jax.eval_shape(lambda: engine.device.empty(size=slots, window=window)), empty.output_shardings)
    plain = shard_bytes(model.params)
    copies = IN_RUN_COPIES if cfg.eval.every_steps else (1 if cfg.model.lora is not None else 0)
    return {"rows": rows, "slots": slots, "decode_weights": shard_bytes(weights), "kv_cache": shard_bytes(kv),
            "weight_copies": copies * plain, "during_rl": bool(cfg.eval.every_steps)}


def evaluation_bytes(report: dict | None) -> int:
    """What the evaluation adds on a trainer device (0 when it never evaluates)."""
    if report is None:
        return 0
    return report["decode_weights"] + report["kv_cache"] + report["weight_copies"]
