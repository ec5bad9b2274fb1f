"""Every multi-turn environment by its config name (environment.name). Adding one: a module with
`build(cfg, task, tokenizer) -> Environment` (base.py) and a line here."""

from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class EnvironmentSpec:
    module: str                 # defines build(cfg, task, tokenizer)
    tasks: tuple[str, ...]      # the task.name values whose problems it takes


ENVIRONMENTS: dict[str, EnvironmentSpec] = {
    # the multi-turn CPU demo: addition problems with a calculator tool
    "arith_tools": EnvironmentSpec("grpo_stream.common.environments.arith_tools", ("arith_tools", "arith")),
    # GSM8K with a calculator and a sandboxed Python tool, tool calls in the model family's format
    "gsm8k_tools": EnvironmentSpec("grpo_stream.common.environments.gsm8k_tools", ("gsm8k",)),
}


def environment_spec(name: str) -> EnvironmentSpec:
    try:
        return ENVIRONMENTS[name]
    except KeyError:
        raise ValueError(f"environment.name={name!r}: unknown; choose one of {sorted(ENVIRONMENTS)}, or null for "
                         "single-turn tasks") from None


def build_environment(cfg, task, tokenizer):
    """The run's environment (cfg.environment.name must be set)."""
    spec = environment_spec(cfg.environment.name)
    if cfg.task.name not in spec.tasks:
        raise ValueError(f"environment.name={cfg.environment.name} takes the problems of task.name in "
                         f"{list(spec.tasks)}; task.name is {cfg.task.name}")
    return importlib.import_module(spec.module).build(cfg, task, tokenizer)
