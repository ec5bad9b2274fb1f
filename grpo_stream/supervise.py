"""How `up` keeps its processes running: a restart policy per process (up.restart, up.restart_limit_burst,
up.restart_limit_interval_s, up.healthy_after_s, up.restart_backoff_s, up.restart_backoff_max_s), as Kubernetes
restarts a failed pod or JobSet a failed job.

Restarting is safe because every process resumes by itself: the trainer from its newest checkpoint (and the
buffer's pending entries), a sampler from its data position (asked of the ingest), the standalone ingest holds no
state, and the embedded Redis replays its AOF. Each process has its own jittered exponential back-off.

The budget is counted in a time window and reset by healthy uptime, not over the whole run: a week-long run meets
many preemptions of each process, each healed, and must not stop at the sixth. What stops the run is a crash
loop: more than restart_limit_burst restarts of one process within restart_limit_interval_s, none of them followed
by healthy_after_s of uptime (systemd's StartLimitBurst/StartLimitIntervalSec; Kubernetes resets CrashLoopBackOff
once a container ran 10 minutes). A process that ran healthy_after_s also starts its back-off again from the
first wait.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

from grpo_stream.common.config.process import UpSection
from grpo_stream.common.runtime.backoff import Backoff


class Supervisor:
    """Decides, per failed process, whether and when it starts again, and counts restarts for summary.json."""

    def __init__(self, policy: UpSection, clock: Callable[[], float] = time.monotonic):
        self.policy, self.clock = policy, clock
        self.restarts: collections.Counter = collections.Counter()  # every restart of the run, per process
        self._due: dict[str, float] = {}
        self._backoff: dict[str, Backoff] = {}
        self._counted: dict[str, collections.deque] = collections.defaultdict(collections.deque)  # restart times
        self._since = clock()  # every process started before the supervisor was made
        self._started: dict[str, float] = {}

    def failed(self, name: str) -> float | None:
        """Process `name` failed (exit code not 0, or killed): the seconds until it restarts, or None when the run
        must stop instead (restart: never, or the burst used up within the window). Call once per failure."""
        if self.policy.restart == "never":
            return None
        now = self.clock()
        counted = self._counted[name]
        if now - self._started.get(name, self._since) >= self.policy.healthy_after_s:
            counted.clear()  # it ran healthy: earlier restarts were not a loop, and the back-off starts again
            self._backoff.pop(name, None)
        while counted and now - counted[0] >= self.policy.restart_limit_interval_s:
            counted.popleft()
        if len(counted) >= self.policy.restart_limit_burst:
            return None
        backoff = self._backoff.setdefault(name, Backoff(self.policy.restart_backoff_s,
                                                         self.policy.restart_backoff_max_s))
        delay = backoff.next()
        self._due[name] = now + delay
        return delay

    def budget(self, name: str) -> str:
        """How much of `name`'s restart budget is used, for `up`'s log lines."""
        p = self.policy
        if p.restart == "never":
            return "up.restart=never"
        return (f"{len(self._counted[name])} of up.restart_limit_burst={p.restart_limit_burst} restarts within "
                f"up.restart_limit_interval_s={p.restart_limit_interval_s:g}s, none followed by "
                f"up.healthy_after_s={p.healthy_after_s:g}s of uptime")

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
            self._counted[name].append(now)
            self._started[name] = now
        return ready
