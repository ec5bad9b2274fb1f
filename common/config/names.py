"""Config fields that name a registered backend: checked against its registry (common/registry/) when the config is
validated."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

from grpo_stream.common.registry.base import Registry
from grpo_stream.common.registry.engines import ENGINES
from grpo_stream.common.registry.environments import ENVIRONMENTS
from grpo_stream.common.registry.tasks import TASKS
from grpo_stream.common.registry.transports import TRANSPORTS


def _registered(registry: Registry) -> AfterValidator:
    """A name that must be registered (read at validation time, so a registered backend is accepted); None passes
    (a field that may be unset)."""
    def check(name: str | None) -> str | None:
        if name is not None and name not in registry:
            raise ValueError(registry.unknown(name))
        return name
    return AfterValidator(check)


TaskName = Annotated[str, _registered(TASKS)]
EngineName = Annotated[str, _registered(ENGINES)]
TransportName = Annotated[str, _registered(TRANSPORTS)]
EnvironmentName = Annotated[str | None, _registered(ENVIRONMENTS)]
