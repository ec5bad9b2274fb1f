"""The multi-turn environment of a run: the one its config names (environment.name) in
common/registry/environments.py."""

from __future__ import annotations

from grpo_stream.common.registry.environments import ENVIRONMENTS


def build_environment(cfg, task, tokenizer):
    """The run's environment (cfg.environment.name must be set)."""
    spec = ENVIRONMENTS.lookup(cfg.environment.name)
    if cfg.task.name not in spec.tasks:
        raise ValueError(f"environment.name={cfg.environment.name} takes the problems of task.name in "
                         f"{list(spec.tasks)}; task.name is {cfg.task.name}")
    return ENVIRONMENTS.load(cfg.environment.name, "build")(cfg, task, tokenizer)
