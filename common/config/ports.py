"""The fixed ports a run's config asks one process to serve on: checked when the config is validated, so two servers
of one process given the same port, or a port past 65535 for a later process (trainer.port + k, sampler.metrics_port
+ i), are refused naming the fields, instead of a bind error when the process starts (after a model has loaded)."""

from __future__ import annotations

from typing import Any

from grpo_stream.common.registry.transports import transport_spec

MAX_PORT = 65535


def _trainer_ports(cfg: Any) -> list[tuple[str, int, int]]:
    """(field, port, how many processes serve on port + k) of a trainer process's servers with a fixed port."""
    n, weights = cfg.trainer.processes, cfg.weights
    ports = [("trainer.port", cfg.trainer.port, n), ("trainer.metrics_port", cfg.trainer.metrics_port or 0, 1)]
    if transport_spec(weights.transport).trainer_serves and weights.data_plane == "tcp":
        ports.append(("weights.data_port", weights.data_port, n))
    return [p for p in ports if p[1]]


def _sampler_ports(cfg: Any) -> list[tuple[str, int, int]]:
    """The same for a sampler process (sampler i serves on port + i)."""
    n = cfg.sampler.replicas
    ports = [("sampler.metrics_port", cfg.sampler.metrics_port or 0, n), ("sampler.openai.port",
                                                                          cfg.sampler.openai.port or 0, n)]
    return [p for p in ports if p[1]]


def port_problem(cfg: Any) -> str | None:
    """Why the config's fixed ports cannot all be bound, naming the fields and the fix; None when they can. Ports of
    different processes (a trainer's and a sampler's) may be equal: they may run on different hosts."""
    for who, ports in (("trainer process", _trainer_ports(cfg)), ("sampler", _sampler_ports(cfg))):
        for field, port, count in ports:
            if port + count - 1 > MAX_PORT:
                return (f"{field}={port}: {who} {count - 1} serves on {field} + {count - 1} = {port + count - 1}, "
                        f"past {MAX_PORT}; lower it to at most {MAX_PORT - count + 1} (or 0 for a free port)")
        for i, (field, port, _) in enumerate(ports):
            for other, other_port, _ in ports[:i]:
                if port == other_port:
                    return (f"{field}={port} is also {other}: one process would serve two servers on one port (the "
                            f"second fails to bind when it starts); give {field} another port, or 0 for a free one")
    return None
