"""A call made with a time bound it cannot be made to keep: code of a user or a model's choosing (an environment's
step, an in-process tool) that may never return. Python cannot stop a thread, so the call runs on a daemon thread of
its own and, past its time, is given up rather than stopped: what it answers late is dropped, and it never holds up
the process's exit."""

from __future__ import annotations

import threading
from typing import Any, Callable


class GivenUp(Exception):
    """The call did not answer within its time; it is left running on its daemon thread."""


def call_within(call: Callable[[], Any], seconds: float, name: str) -> Any:
    """`call()`, or GivenUp once `seconds` pass; what it raises is raised here. `name`: its thread's (for stacks)."""
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(max(0.0, seconds))
    if not outcome:
        raise GivenUp(name)
    answered, value = outcome[0]
    if not answered:
        raise value
    return value
