"""A call made with a time bound it cannot be made to keep: code of a user or a model's choosing (an environment's
step, an in-process tool) that may never return. Python cannot stop a thread, so the call runs on a daemon thread of
its own and, past its time, is given up rather than stopped: what it answers late is dropped, and it never holds up
the process's exit.

Given-up threads still run, and each holds what its call holds (a stack, buffers, a socket). A dependency that never
returns would leave one more on every call, without bound, so once MAX_GIVEN_UP of them still run a new call is
refused (TooManyGivenUp) with the calls that hang named: the process must be restarted to be rid of them (`up`
restarts a sampler that fails), and the call fixed to return or to honour its own time-out. The count is read from
the live threads (each marked when given up), so one that returns at last no longer counts.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

MAX_GIVEN_UP = 64  # given-up threads still running in one process before new calls are refused
_MARK = "_grpo_stream_given_up"  # set on a thread once its call was given up


class GivenUp(Exception):
    """The call did not answer within its time; it is left running on its daemon thread."""


class TooManyGivenUp(RuntimeError):
    """Too many calls given up on still run in this process: no new one is started."""


def _given_up_names() -> list[str]:
    """The names of this process's threads whose call was given up and that still run."""
    return [thread.name for thread in threading.enumerate() if getattr(thread, _MARK, False)]


def given_up_count() -> int:
    """Threads of this process whose call was given up and that still run."""
    return len(_given_up_names())


def call_within(call: Callable[[], Any], seconds: float, name: str, limit: int = MAX_GIVEN_UP) -> Any:
    """`call()`, or GivenUp once `seconds` pass; what it raises is raised here. `name`: its thread's (for stacks).
    TooManyGivenUp, before anything starts, when `limit` given-up calls still run."""
    hung = _given_up_names()
    if len(hung) >= limit:
        names = ", ".join(f"{n} ({k})" for n, k in collections.Counter(hung).most_common(5))
        raise TooManyGivenUp(
            f"{len(hung)} calls given up on are still running in this process (at most {limit}); {name} was not "
            f"started. Those that hang: {names}. Make that environment step or tool return, or honour its own "
            "time-out (environment.turn_tool_seconds bounds only the wait, not the call); restarting the process "
            "frees them")
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
        setattr(thread, _MARK, True)
        if not outcome:  # it may have answered meanwhile: then it is no longer running anyway
            raise GivenUp(name)
    answered, value = outcome[0]
    if not answered:
        raise value
    return value
