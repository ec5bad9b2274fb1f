"""What each `grpo-stream` command does once its arguments are parsed: one handler per command in `COMMANDS`, which
grpo_stream/cli.py dispatches to.

A handler returns its exit code (None: 0), or raises. It never maps exceptions to exit codes itself: cli.py's one
exit-code policy does, from what the handler raised and the command's entry here (`usage_errors`, `process`).
Handlers import JAX and the services inside their bodies, after the config is sound, so `--help` and a config error
are instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import sys
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("grpo_stream.cli")
EXPECTED_ERRORS = (ValueError, OSError, RuntimeError)  # a bad input, an unreachable service, an XLA or device error


@dataclass(frozen=True)
class Command:
    """One command of the table.

    run: the handler, given the parsed arguments and, when `config` is set, the loaded config (else None).
    config: load --config and the overrides first; --print-config prints them and stops there.
    usage_errors: what this command raises when what it was given cannot be used (exit 2 instead of 1). A command
        whose exit 1 is a verdict (audit: groups lost; plan: does not fit) lists every expected error here, so 1
        keeps its meaning.
    process: for a process `up` supervises, its name in RUN_DIR/failures (common/runtime/errors.py): a
        PermanentError it raises is recorded there under this name for `up` to report.
    """

    run: Callable[[argparse.Namespace, object], int | None]
    config: bool = False
    usage_errors: tuple[type[BaseException], ...] = ()
    process: Callable[[argparse.Namespace], str] | None = None


def _bench(args, _cfg) -> int:
    from grpo_stream.bench.runner import run_benchmarks

    return run_benchmarks(args.name, args.json, args.table, args.quick)


def _report(args, _cfg) -> None:
    from grpo_stream.reports.run_report import make_report

    out = make_report(args.run_dir)
    print(f"report written to {out}/report.md")


def _config(args, _cfg) -> None:
    from grpo_stream.common.config.base import ConfigError
    from grpo_stream.common.config.describe import describe
    from grpo_stream.common.config.loading import load_config, to_yaml
    from grpo_stream.common.config.schema import RunConfig

    if args.config_command == "show":
        print(to_yaml(load_config(args.config, args.overrides), redact=True), end="")
        return
    try:
        text = describe(RunConfig, args.prefix)
    except ValueError as exc:  # a prefix no field has: the user's input about the config
        raise ConfigError(str(exc)) from exc
    print(text, end="")


def _client(args, cfg) -> int:
    from grpo_stream.client.submit import run_cancel, run_results, run_status, run_submit, run_tokens

    return {"submit": run_submit, "status": run_status, "results": run_results, "cancel": run_cancel,
            "tokens": run_tokens}[args.command](args, cfg)


def _fixture(args, _cfg) -> None:
    from grpo_stream.fixture import run_fixture

    run_fixture(args)


def _audit(args, _cfg) -> int:
    from grpo_stream.reports.audit import run_audit

    return run_audit(args.run_dir, args.redis_url, args.group, args.json)


def _eval(args, cfg) -> None:
    from grpo_stream.common.assembly.compilation_cache import enable_compilation_cache
    from grpo_stream.common.runtime.process import import_tensorboardx_without_torch, setup_logging
    from grpo_stream.reports.evaluate import run_eval
    from grpo_stream.common.tasks.rewards import scored_by

    setup_logging(cfg.logging.level, "eval", cfg.logging.format, cfg.logging.verbose)
    import_tensorboardx_without_torch()
    cache = enable_compilation_cache(cfg)
    doc = run_eval(cfg, args.split, args.limit, args.json)
    log.info("%s", cache.summary())
    ks = ", ".join(f"pass@{k} {doc['pass_at_k'][k]:.3f}, maj@{k} {doc['maj_at_k'][k]:.3f}" for k in doc["pass_at_k"])
    # the task's own figures (IFEval's four) when it has them, else greedy pass@1 (answer_correct)
    head = ", ".join(f"{name} {value:.4f}" for name, value in doc["task_metrics"].items())
    print(f"{doc['split']}: {doc['num_problems']} problems, " + (head or f"greedy pass@1 {doc['accuracy']:.3f}")
          + (f", {ks}" if ks else "") + f"; greedy {scored_by(doc['reward_weights'])} {doc['reward']:.3f}"
          + (f"; wrote {args.json}" if args.json else ""))


def _plan(args, cfg) -> int:
    from grpo_stream.common.runtime.process import setup_logging
    from grpo_stream.plan.memory import run_plan

    setup_logging(cfg.logging.level, "plan", cfg.logging.format, cfg.logging.verbose)
    return run_plan(cfg, args.json)


def _devices(args, cfg) -> int:
    from grpo_stream.plan.devices import run_devices

    return run_devices(cfg, args.gpus, args.gpu_memory_gib, args.compose, args.json)


def _up(args, cfg) -> int:
    from grpo_stream.common.assembly.compilation_cache import compilation_cache_dir
    from grpo_stream.common.runtime.process import setup_logging
    from grpo_stream.up.run import run_up

    setup_logging(cfg.logging.level, "up", cfg.logging.format, cfg.logging.verbose)
    compilation_cache_dir(cfg)  # `up` compiles nothing itself; a bad cache directory stops it before any process
    run_dir = args.run_dir or pathlib.Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return run_up(args.config, args.overrides, cfg, run_dir)


def _prepare_process(args, cfg, name: str) -> None:
    """What every service process does before its work: logging named after it, dying with `up`, the device plan's
    settings and XLA's flags in the environment before JAX starts (it reads them once)."""
    from grpo_stream.plan.device_plan import device_env, own_process_env
    from grpo_stream.up.parent_death import watch_parent
    from grpo_stream.common.runtime.process import hold_stop_signals, setup_logging

    hold_stop_signals()  # until the loop's own handlers: a stop while JAX is imported must not kill it
    setup_logging(cfg.logging.level, name, cfg.logging.format, cfg.logging.verbose)
    watch_parent()  # a child of `up` stops when `up` is gone (grpo_stream/up/parent_death.py)
    os.environ.update(own_process_env(cfg, args.command, os.environ))
    if device_env(os.environ):
        log.info("device settings: %s", " ".join(f"{k}={v}" for k, v in device_env(os.environ).items()))
    if cfg.run.deterministic:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()


def _jax_process(args, cfg) -> None:
    """trainer, sampler, colocated: the shared start of a JAX service process, then its loop."""
    if args.command == "sampler" and args.index >= cfg.sampler.replicas:  # before JAX's start-up; exit 2
        from grpo_stream.common.config.base import ConfigError

        raise ConfigError(f"--index {args.index}: a sampler's index is in 0..{cfg.sampler.replicas - 1} "
                          f"(sampler.replicas={cfg.sampler.replicas}); give a smaller --index or raise "
                          "sampler.replicas")
    from grpo_stream.common.assembly.compilation_cache import enable_compilation_cache
    from grpo_stream.common.runtime.process import import_tensorboardx_without_torch, pin_to_cpus

    _prepare_process(args, cfg, args.command if args.command != "sampler" else f"sampler-{args.index}")
    pin_to_cpus(*((cfg.sampler.cpu_affinity, "sampler.cpu_affinity") if args.command == "sampler" else
                  (cfg.trainer.cpu_affinity, "trainer.cpu_affinity")))
    import_tensorboardx_without_torch()
    cache = enable_compilation_cache(cfg)
    from grpo_stream.common.model.sharding import initialize_distributed

    initialize_distributed(cfg.distributed.initialize)
    if args.command == "sampler":
        from grpo_stream.sampler_service.loop import run_sampler

        run_sampler(cfg, args.index, args.run_dir)
    else:
        args.run_dir = args.run_dir or pathlib.Path("runs") / cfg.run.name  # where a failure is recorded, too
        args.run_dir.mkdir(parents=True, exist_ok=True)
        if args.command == "colocated":
            from grpo_stream.up.colocated import run_colocated

            run_colocated(cfg, args.run_dir)
        else:
            from grpo_stream.trainer_service.loop import run_trainer

            run_trainer(cfg, args.run_dir)
    log.info("%s", cache.summary())


def _ingest(args, cfg) -> None:
    """The standalone ingest: Redis and gRPC only, no JAX, so no compilation cache."""
    from grpo_stream.trainer_service.ingest.server import run_ingest

    _prepare_process(args, cfg, "ingest")
    run_ingest(cfg)


def trainer_process_name(_args=None) -> str:
    """trainer-<k>: this trainer process's index in its JAX job (what `up` and the heartbeats call it)."""
    jax = sys.modules.get("jax")
    try:
        if jax is not None and jax.distributed.is_initialized():
            return f"trainer-{jax.process_index()}"
    except Exception:  # noqa: BLE001 - naming a failure must not fail: fall back to the environment
        pass
    index = os.environ.get("JAX_PROCESS_ID", "0")
    return f"trainer-{index if index.isdigit() else 0}"


_VERDICT = EXPECTED_ERRORS  # a verdict command that could not judge exits 2, keeping 1 for its verdict

COMMANDS: dict[str, Command] = {
    "up": Command(_up, config=True),
    "trainer": Command(_jax_process, config=True, process=trainer_process_name),
    "colocated": Command(_jax_process, config=True, process=trainer_process_name),
    "sampler": Command(_jax_process, config=True, process=lambda args: f"sampler-{args.index}"),
    "ingest": Command(_ingest, config=True, process=lambda _args: "ingest"),
    "eval": Command(_eval, config=True),
    "plan": Command(_plan, config=True, usage_errors=_VERDICT),
    "devices": Command(_devices, config=True),
    "audit": Command(_audit, usage_errors=_VERDICT),
    "report": Command(_report, usage_errors=(FileNotFoundError,)),  # a directory no run wrote
    "fixture": Command(_fixture, usage_errors=(ValueError,)),  # a bad --source or --out; a failed download exits 1
    "bench": Command(_bench),
    "config": Command(_config),
    # config=True: --config (TLS, auth) is loaded, and --print-config prints it without connecting. ValueError: a bad
    # prompts file, no endpoints.json, or a request the server refuses (client/errors.py)
    "submit": Command(_client, config=True, usage_errors=(ValueError, OSError)),
    "status": Command(_client, config=True, usage_errors=(ValueError, OSError)),
    "results": Command(_client, config=True, usage_errors=(ValueError, OSError)),
    "cancel": Command(_client, config=True, usage_errors=(ValueError, OSError)),
    "tokens": Command(_client, usage_errors=(ValueError, OSError)),
}
