"""Every rollout-buffer backend by name. Adding one: a module implementing buffer.RolloutBuffer and a line here.

'redis' is what every process-separated deployment uses (the ingest, trainer and `audit` share it); 'memory' holds
the buffer inside one process, for unit tests of the trainer loop."""

from __future__ import annotations

import threading

from grpo_stream.common.registry.base import Registry
from grpo_stream.common.rollouts.buffer import RedisStreamBuffer, RolloutBuffer
from grpo_stream.common.rollouts.memory_buffer import InMemoryBuffer
from grpo_stream.common.rollouts.redis_server import connect_durable
from grpo_stream.common.rollouts.trainer_lease import TrainerLease


def _redis(cfg, stop=None) -> RolloutBuffer:
    if cfg.redis.url is None:
        raise ValueError("redis.url is null: give the buffer's Redis URL (e.g. redis.url=redis://host:6379/0), or "
                         "run `grpo-stream up`, which starts an embedded Redis")
    return RedisStreamBuffer(connect_durable(cfg.redis, "trainer", stop), cfg.run.name)


def _memory(cfg, stop=None) -> RolloutBuffer:
    return InMemoryBuffer()


BUFFERS = Registry("rollout buffer", "backend", {"redis": _redis, "memory": _memory})


def open_buffer(cfg, backend: str = "redis", stop=None) -> RolloutBuffer:
    """The run's buffer; `stop` (the process's stop event) ends a wait for an unreachable store."""
    return BUFFERS.lookup(backend)(cfg, stop)


def open_leased_buffer(cfg, stop: threading.Event | None) -> tuple[RolloutBuffer, TrainerLease | None]:
    """(the run's buffer, this trainer's lease on it), the lease taken before the trainer writes anything (the
    buffer, or the checkpoint directory it shares with any other trainer of the run). No lease for a backend that
    needs none (in memory: the buffer lives and dies with its one process). `stop` ends the waits."""
    buffer = open_buffer(cfg, stop=stop)
    lease = TrainerLease.take(buffer, cfg.trainer.lease_ttl_s, stop) if hasattr(buffer, "use_fence") else None
    return buffer, lease
