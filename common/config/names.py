"""Config fields that name a registered backend: checked against its registry when the config is validated."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from grpo_stream.common.engine.registry import ENGINES
from grpo_stream.common.tasks.registry import TASKS
from grpo_stream.common.weights.registry import TRANSPORTS


def _registered(kind: str, registry: dict) -> AfterValidator:
    """A name that must be a key of `registry` (read at validation time, so a registered backend is accepted)."""
    def check(name: str) -> str:
        if name not in registry:
            raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(registry)}")
        return name
    return AfterValidator(check)


TaskName = Annotated[str, _registered("task", TASKS)]
EngineName = Annotated[str, _registered("engine", ENGINES)]
TransportName = Annotated[str, _registered("transport", TRANSPORTS)]
