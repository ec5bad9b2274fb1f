"""Exponential back-off with jitter: the one helper every retry loop uses (samplers' streams, weight fetches,
start-up contacts, Redis connections, the trainer's buffer reads, checkpoint restores).

Why jitter: after a trainer or Redis restart, every sampler sees the failure at the same moment; with plain
doubling they would all retry at the same instants and hit the restarted server in waves. Each wait here is
"equal jitter": half of the exponential step fixed, half drawn at random, so waits spread over [d/2, d] (never
near zero, which would turn a wave into a busy loop) and the processes drift apart from the first retry on.

Every wait also ends at once when the process is asked to stop (`wait`, `StopRequested`): a loop that retries a
dependency that is down (Redis, the ingest) must not hold a SIGTERM for its whole back-off, or for ever when the
dependency never comes back (a stop requested while Redis is down: `up` stops the run and does not restart Redis).
"""

from __future__ import annotations

import math
import random
import threading
import time


class StopRequested(RuntimeError):
    """A retry loop gave up because its process was asked to stop before what it retried succeeded. A RuntimeError,
    so the entry points print it as one line and exit non-zero; what was not done is redone on the next start."""


def wait(seconds: float, stop: threading.Event | None) -> bool:
    """Sleep `seconds`, or less when `stop` is set meanwhile; True when the process is stopping (then at once)."""
    if stop is None:
        time.sleep(seconds)
        return False
    return stop.wait(seconds)


class Backoff:
    """Waits of initial_s, 2 initial_s, 4 initial_s, ... capped at max_s, each drawn uniformly from [d/2, d]."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None):
        if not 0 < initial_s <= max_s < math.inf:  # an infinite cap is none: waits of hours after a long outage
            raise ValueError(f"back-off needs 0 < initial_s ({initial_s}) <= max_s ({max_s}), max_s finite")
        self.initial_s, self.max_s = initial_s, max_s
        self.attempts = 0  # waits handed out since the last reset
        self._rng = rng or random.Random()  # seeded from the OS: no two processes share a sequence

    def step_s(self) -> float:
        """The exponential step (no jitter) the next wait is drawn under."""
        return min(self.initial_s * 2 ** min(self.attempts, 64), self.max_s)

    def next(self) -> float:
        """Seconds to wait before the next attempt."""
        step = self.step_s()
        self.attempts += 1
        return step / 2 + self._rng.uniform(0, step / 2)

    @property
    def at_cap(self) -> bool:
        """The steps have reached max_s (a loop may log less often from here)."""
        return self.step_s() >= self.max_s

    def reset(self) -> None:
        """After a success: the next failure starts again from initial_s."""
        self.attempts = 0
