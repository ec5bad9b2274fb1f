"""The task of a run: the one its config names (task.name) in common/registry/tasks.py."""

from __future__ import annotations

from grpo_stream.common.registry.tasks import TASKS


def build_task_for(cfg, hf_tokenizer):
    return TASKS.load(cfg.task.name, "build")(cfg, hf_tokenizer)
