"""How `up` keeps its processes running: a restart policy per process (up.restart, up.max_restarts,
up.restart_backoff_s), as Kubernetes restarts a failed pod or JobSet a failed job.

Restarting is safe because every process resumes by itself: the trainer from its newest checkpoint (and the
buffer's pending entries), a sampler from its data position (asked of the ingest), the standalone ingest holds no
state, and the embedded Redis replays its AOF. Each process has its own jittered exponential back-off, and a
process that fails more than max_restarts times stops the run: a crash loop is a bug to read in the logs.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

from grpo_stream.common.config.process import UpSection
from grpo_stream.common.runtime.backoff import Backoff

MAX_BACKOFF_S = 30.0


class Supervisor:
    """Decides, per failed process, whether and when it starts again, and counts restarts for summary.json."""

    def __init__(self, policy: UpSection, clock: Callable[[], float] = time.monotonic):
        self.policy, self.clock = policy, clock
        self.restarts: collections.Counter = collections.Counter()
        self._due: dict[str, float] = {}
        self._backoff: dict[str, Backoff] = {}

    def failed(self, name: str) -> float | None:
        """Process `name` failed (exit code not 0, or killed): the seconds until it restarts, or None when the run
        must stop instead (restart: never, or max_restarts used up). Call once per failure."""
        if self.policy.restart == "never" or self.restarts[name] >= self.policy.max_restarts:
            return None
        backoff = self._backoff.setdefault(name, Backoff(self.policy.restart_backoff_s,
                                                         max(MAX_BACKOFF_S, self.policy.restart_backoff_s)))
        delay = backoff.next()
        self._due[name] = self.clock() + delay
        return delay

    def waiting(self, name: str) -> bool:
        """A restart of `name` is scheduled and not yet made."""
        return name in self._due

    def due(self) -> list[str]:
        """The processes whose restart time has come (each is counted as restarted and taken off the schedule)."""
        now = self.clock()
        ready = [name for name, at in self._due.items() if at <= now]
        for name in ready:
            del self._due[name]
            self.restarts[name] += 1
        return ready
