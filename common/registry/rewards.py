"""The built-in rewards by their config name (a key of task.rewards), so the config refuses a misspelt one when it
loads, before `up` starts a process (the rewards' own module, common/tasks/rewards.py, imports IFEval's checks and the
answer parser; it builds its table of functions from these names). Adding one: its function there and a line here."""

from __future__ import annotations

import dataclasses

from grpo_stream.common.registry.base import Registry


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    function: str  # its function's name in common/tasks/rewards.py


BUILTIN_REWARDS: Registry[RewardSpec] = Registry("task.rewards", "built-in reward", {
    "answer_correct": RewardSpec("answer_correct"),
    "answer_format": RewardSpec("answer_format"),
    "last_number": RewardSpec("last_number"),  # chat replies: the last number written is the answer
    "reasoning_answer_format": RewardSpec("reasoning_answer_format"),
    "ifeval_strict": RewardSpec("ifeval_strict"),  # task.name=ifeval: share of the prompt's instructions followed
    "ifeval_loose": RewardSpec("ifeval_loose"),
}, otherwise=", or an import path 'package.module:function'")
