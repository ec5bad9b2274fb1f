"""Every rollout-buffer backend by name. Adding one: a module implementing buffer.RolloutBuffer and a line here.

'redis' is what every process-separated deployment uses (the ingest, trainer and `audit` share it); 'memory' holds
the buffer inside one process, for unit tests of the trainer loop."""

from __future__ import annotations

from typing import Callable

from grpo_stream.common.rollouts.buffer import RolloutBuffer


def _redis(cfg, stop=None) -> RolloutBuffer:
    from grpo_stream.common.rollouts.buffer import RedisStreamBuffer  # noqa: PLC0415
    from grpo_stream.common.rollouts.redis_server import connect_durable  # noqa: PLC0415

    if cfg.redis.url is None:
        raise ValueError("redis.url is null: give the buffer's Redis URL (e.g. redis.url=redis://host:6379/0), or "
                         "run `grpo-stream up`, which starts an embedded Redis")
    return RedisStreamBuffer(connect_durable(cfg.redis, "trainer", stop), cfg.run.name)


def _memory(cfg, stop=None) -> RolloutBuffer:
    from grpo_stream.common.rollouts.memory_buffer import InMemoryBuffer  # noqa: PLC0415

    return InMemoryBuffer()


BUFFERS: dict[str, Callable[..., RolloutBuffer]] = {"redis": _redis, "memory": _memory}


def open_buffer(cfg, backend: str = "redis", stop=None) -> RolloutBuffer:
    """The run's buffer; `stop` (the process's stop event) ends a wait for an unreachable store."""
    try:
        factory = BUFFERS[backend]
    except KeyError:
        raise ValueError(f"rollout buffer {backend!r}: unknown; choose one of {sorted(BUFFERS)}") from None
    return factory(cfg, stop)
