"""What every trainer process builds before it trains: the task and tokenizer, the policy read straight onto the
trainer mesh, the evaluation engine and the distillation teacher (core.py's TrainerCore then applies plans with
them)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax

from grpo_stream.common.assembly.parts import build_policy, build_task_and_tokenizer
from grpo_stream.common.config.schema import RunConfig
from grpo_stream.common.engine import continuous
from grpo_stream.common.model.sharding import make_mesh, place
from grpo_stream.trainer_service.learning.distill import Teacher, load_teacher

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """What every trainer process holds: the task, tokenizer, model (params placed on the trainer mesh, which spans
    every process's devices), the evaluation engine and the distillation teacher (None without one)."""
    task: Any
    tokenizer: Any
    model: Any
    mesh: jax.sharding.Mesh
    engine: Any
    teacher: Teacher | None = None


def build_model_parts(cfg: RunConfig, devices=None) -> ModelParts:
    task, tokenizer = build_task_and_tokenizer(cfg)
    m = cfg.trainer.mesh
    mesh = make_mesh(m.fsdp, m.tp, devices or jax.devices(), "trainer.mesh")
    # a checkpoint straight onto the mesh (each device its slices); the tiny model, made on one device, placed after
    model = build_policy(cfg, tokenizer.vocab_size, seed=cfg.run.seed, mesh=mesh)
    model = dataclasses.replace(model, params=place(model.params, mesh))
    log.info("trainer mesh %s on %s", dict(mesh.shape), [d.id for d in mesh.devices.flat])
    log.info("model: %d parameters, vocab %d, tokenizer %s", model.num_params(), tokenizer.vocab_size,
             tokenizer.fingerprint())
    # the teacher after the student: its tokenizer is checked against the student's before its weights are read
    teacher = load_teacher(cfg, tokenizer, mesh)
    return ModelParts(task, tokenizer, model, mesh, continuous.build(cfg, model, tokenizer), teacher)
