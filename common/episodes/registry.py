"""Every rollout kind, and which one a run uses. A kind makes a group's episodes on the rollout stream
(stream.py `Rollouts`); every kind hands its episodes to the one group builder (groups.py). Adding one: a module with
`build(cfg, task, tokenizer, routes) -> Rollouts` and a line here, and a rule in `rollout_kind`.

`routes`: the process's in-memory OpenAI-compatible routes (common/endpoint/app.py InProcessRoutes), for kinds whose
episodes call a model over that API (a `verifiers` environment); None where there are none.
"""

from __future__ import annotations

import dataclasses

from grpo_stream.common.registry.base import Registry
from grpo_stream.common.registry.tasks import task_spec


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    module: str           # defines build(cfg, task, tokenizer, routes)
    needs_routes: bool = False  # its episodes call the OpenAI-compatible routes (routes must be given)
    injected: str = ""    # the kind injected prompts run as (they have no row of an environment's own dataset); "":
    #                       this one


ROLLOUTS: Registry[RolloutSpec] = Registry("rollout kind", "kind", {
    # a prompt, one model turn (tasks without an environment)
    "single_turn": RolloutSpec("grpo_stream.common.episodes.single_turn"),
    # model turns and an environment's observations (environment.name)
    "environment": RolloutSpec("grpo_stream.common.episodes.tool_turns"),
    # a `verifiers` environment's own rollouts and rubric (task.name=verifiers)
    "verifiers": RolloutSpec("grpo_stream.common.episodes.verifiers", needs_routes=True, injected="single_turn"),
})


def rollout_kind(cfg) -> str:
    """The kind of a run's own rollouts: a task that runs its own (a verifiers environment), else an environment's
    episodes when environment.name is set, else single turns."""
    if task_spec(cfg.task.name).own_rollouts:
        return "verifiers"
    return "environment" if cfg.environment.name is not None else "single_turn"


def build_rollouts(cfg, task, tokenizer, routes=None, kind: str | None = None):
    """The rollouts of `kind` (default: the run's, `rollout_kind`)."""
    kind = kind or rollout_kind(cfg)
    if ROLLOUTS.lookup(kind).needs_routes and routes is None:
        raise ValueError(f"{kind} rollouts call the OpenAI-compatible routes; this process has none")
    return ROLLOUTS.load(kind, "build")(cfg, task, tokenizer, routes)


def injected_kind(cfg) -> str:
    """The kind injected prompts of this run are made with."""
    kind = rollout_kind(cfg)
    return ROLLOUTS.lookup(kind).injected or kind
