"""Every multi-turn environment by its config name (environment.name). Adding one: a module with
`build(cfg, task, tokenizer) -> Environment` (common/environments/base.py) and a line here."""

from __future__ import annotations

import dataclasses

from grpo_stream.common.registry.base import Registry


@dataclasses.dataclass(frozen=True)
class EnvironmentSpec:
    module: str                 # defines build(cfg, task, tokenizer)
    tasks: tuple[str, ...]      # the task.name values whose problems it takes


ENVIRONMENTS: Registry[EnvironmentSpec] = Registry("environment.name", "environment", {
    # the multi-turn CPU demo: addition problems with a calculator tool
    "arith_tools": EnvironmentSpec("grpo_stream.common.environments.arith_tools", ("arith_tools", "arith")),
    # GSM8K with a calculator and a sandboxed Python tool, tool calls in the model family's format
    "gsm8k_tools": EnvironmentSpec("grpo_stream.common.environments.gsm8k_tools", ("gsm8k",)),
}, otherwise=", or null for single-turn tasks")
environment_spec = ENVIRONMENTS.lookup
