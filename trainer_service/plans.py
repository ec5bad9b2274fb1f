"""What a trainer process does, as typed, frozen plans: the only input of `TrainerCore` (core.py).

Every trainer process runs `for plan in source: core.apply(plan)`. A one-process trainer makes its plans itself
(plan_sources.LocalSource); in a trainer of several processes process 0 makes them and sends each to the others
(LeaderSource), which receive them (FollowerSource). So the processes cannot drift apart: every device program, every
collective and every checkpoint save follows from the same plan, applied by the same code.

What a plan does not carry is the same in every process by construction: the config (each process reads the same
one, which multihost.check_same_config makes sure of at start; `start_plan` and `finish_plan` derive the config-given
parts in one place) and what the core computes.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np

from grpo_stream.common.config.schema import RunConfig
from grpo_stream.trainer_service.learning.batching import TrainBatch
from grpo_stream.trainer_service.learning.packing import PackedBatch
from grpo_stream.trainer_service.checkpoints.errors import RunRefused
from grpo_stream.trainer_service.control_messages import ControlMessageError, Done, Finish, Start, Step


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """Bring the model to where RL starts or resumes, then publish it."""
    epoch: str  # process 0's trainer epoch: the versions every process publishes are its
    restore: int | None  # the checkpoint step every process restores (process 0's choice); None: a new run
    warm_start: bool  # a new run: the supervised warm start first (warmstart.steps > 0)
    export_warm: bool  # ... and its model exported to RUN_DIR/warmstart-model
    eval_before: bool  # a new run: held-out evaluation before RL


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One RL update on `batch`, then what the step does besides."""
    step: int
    batch: TrainBatch
    checkpoint: bool  # save a checkpoint of this step
    publish: bool  # publish the weights as version `step`
    final: bool  # the run's last step: its publication tells samplers to stop
    evaluate: bool = False  # eval.every_steps: evaluate this step's weights in the background (process 0)
    # [B] the group of each batch row: process 0's off-policy diagnostics (per-group ESS); not sent to the others,
    # which report nothing
    group_index: np.ndarray | None = None
    # `batch` already packed for the update (the plan prefetch packs it beside the previous step's update); not sent
    # either: every process packs the same batch the same way (None: the core packs it)
    packed: PackedBatch | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class FinishPlan:
    """The end of the run (complete, or stopped by a signal)."""
    steps: int  # the step the weights are at
    complete: bool  # every configured step done: evaluate, export, publish the final version
    checkpoint: bool  # a checkpoint of `steps` is still missing (stopped between checkpoints)
    publish: bool  # the final version still has to go out (a resumed, already complete run)
    eval_after: bool  # complete and trainer.eval_after


@dataclasses.dataclass(frozen=True)
class DonePlan:
    """Every sampler has the final version (or the wait ended): stop serving and check the final weights."""
    verify: int  # weights.verify_prompts: greedy probes of the final weights (0: none)


Plan = Union[StartPlan, StepPlan, FinishPlan, DonePlan]


def start_plan(cfg: RunConfig, epoch: str, restore: int | None) -> StartPlan:
    return StartPlan(epoch=epoch, restore=restore, warm_start=cfg.warmstart.steps > 0,
                     export_warm=cfg.warmstart.steps > 0 and cfg.warmstart.export, eval_before=cfg.trainer.eval_before)


def step_plan(cfg: RunConfig, step: int, batch: TrainBatch, group_index: np.ndarray | None = None,
              packed: PackedBatch | None = None) -> StepPlan:
    last = step == cfg.trainer.steps
    return StepPlan(step=step, batch=batch, checkpoint=step % cfg.checkpoint.every == 0 or last,
                    publish=step % cfg.trainer.publish_every == 0 or last, final=last, group_index=group_index,
                    packed=packed, evaluate=evaluated_during_rl(cfg, step))


def check_within_steps(cfg: RunConfig, step: int) -> None:
    """Refuse resuming at RL `step` past trainer.steps (lowered since), before anything is published: resumed there,
    the run would train nothing and never end (export, eval_after, the final version wait for step trainer.steps)."""
    steps = cfg.trainer.steps
    if step > steps:
        raise RunRefused(f"the checkpoint resumed is of RL step {step}, past trainer.steps={steps}: this run trained "
                         f"further than it is now configured to. Set trainer.steps={step} to end it there (export, "
                         "eval_after) or higher to go on, or start a new run (another run.name and checkpoint.dir)")


def evaluated_during_rl(cfg: RunConfig, step: int) -> bool:
    """Whether the weights of RL `step` are due for the evaluation during RL (eval.every_steps): the step a plan
    evaluates, and the restored step a resumed trainer evaluates again when its evaluation was lost. The last
    step's weights are eval_after's when that runs: not evaluated twice."""
    every = cfg.eval.every_steps
    return bool(every) and step % every == 0 and not (step == cfg.trainer.steps and cfg.trainer.eval_after)


def finish_plan(cfg: RunConfig, steps: int, complete: bool, checkpoint: bool, publish: bool) -> FinishPlan:
    return FinishPlan(steps=steps, complete=complete, checkpoint=checkpoint, publish=publish,
                      eval_after=complete and cfg.trainer.eval_after)


def done_plan(cfg: RunConfig) -> DonePlan:
    return DonePlan(verify=cfg.weights.verify_prompts)


# -- plans as control messages (multihost.py carries them, sealed) ---------------------------------------------------
def to_message(plan: Plan) -> tuple[str, dict, dict | None]:
    """(kind, fields, arrays) of the message that carries `plan` to the other processes: what they cannot derive
    from the config themselves."""
    if isinstance(plan, StartPlan):
        return "start", {"epoch": plan.epoch, "restore": plan.restore}, None
    if isinstance(plan, StepPlan):
        arrays = {f.name: getattr(plan.batch, f.name) for f in dataclasses.fields(plan.batch)}
        return "step", {"step": plan.step, "checkpoint": plan.checkpoint, "publish": plan.publish}, arrays
    if isinstance(plan, FinishPlan):
        return "finish", {"steps": plan.steps, "complete": plan.complete, "checkpoint": plan.checkpoint,
                          "publish": plan.publish}, None
    return "done", {}, None


def from_message(cfg: RunConfig, message, arrays: dict) -> Plan:
    """The plan a message from process 0 carries, with the config-given parts derived as process 0 derived them."""
    if isinstance(message, Start):
        return start_plan(cfg, message.epoch, message.restore)
    if isinstance(message, Step):
        plan = step_plan(cfg, message.step, train_batch(arrays))
        return dataclasses.replace(plan, checkpoint=message.checkpoint, publish=message.publish)
    if isinstance(message, Finish):
        return finish_plan(cfg, message.steps, message.complete, message.checkpoint, message.publish)
    if isinstance(message, Done):
        return done_plan(cfg)
    raise ControlMessageError(f"no plan is carried by a message of kind {getattr(message, 'kind', message)!r}")


def train_batch(arrays: dict) -> TrainBatch:
    """The step's batch from process 0's arrays: exactly TrainBatch's fields."""
    names = {f.name for f in dataclasses.fields(TrainBatch)}
    if set(arrays) != names:
        raise ControlMessageError(f"a step message from trainer process 0 holds arrays {sorted(arrays)}, not "
                                  f"{sorted(names)}: the processes run different versions of grpo-stream")
    return TrainBatch(**arrays)
