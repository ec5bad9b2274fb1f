"""Following a redis-server that answers LOADING: it is replaying its data (a resumed run's append-only file), which
can take minutes, and is waited for as long as that goes on (redis_server.wait_serving)."""

from __future__ import annotations

import contextlib
import logging
import time

import redis

log = logging.getLogger(__name__)

LOADING_STALL_S = 30.0  # a load whose read position has not moved for this long is stuck: the wait gives up
LOADING_SAY_S = 5.0  # at most one log line of a long load's progress per this many seconds


class LoadWatch:
    """How far a loading server has read (INFO persistence: loading_loaded_bytes, which INFO answers while it loads),
    and whether that moved since the last look."""

    def __init__(self, where: str, stall_s: float):
        """`where`: the server's address, as logs may show it; `stall_s`: how long a load may not move."""
        self.where, self.stall_s = where, stall_s
        self.position, self.percent, self._said = None, "?", time.monotonic()

    def moved(self, client: redis.Redis) -> bool:
        """Whether the server behind `client`, which answered LOADING, has read more since the last call (the first
        position read counts as a move); one log line of its progress every LOADING_SAY_S while it moves."""
        position = None
        with contextlib.suppress(redis.RedisError, OSError, KeyError, ValueError):  # INFO refused, or the load ended
            info = client.info("persistence")
            position, self.percent = int(info["loading_loaded_bytes"]), f"{info.get('loading_loaded_perc', '?')}%"
        if position is None or position == self.position:
            return False
        self.position, now = position, time.monotonic()
        if now - self._said >= LOADING_SAY_S:
            self._said = now
            log.info("redis-server at %s is loading its data: %s read", self.where, self.percent)
        return True

    def state(self) -> str:
        """What the wait says of the load when it gives up on it."""
        if self.position is None:  # INFO refused or unreadable: the plain timeout applied
            return "it was loading its data, and INFO did not say how far it had read"
        return f"it was loading its data, {self.percent} read, and read no more in {self.stall_s:g}s"
