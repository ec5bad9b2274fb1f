"""`grpo-stream`: the command line. Parses and validates the config first, imports JAX only after.

    grpo-stream up      --config configs/tiny_arith.yaml [--run-dir DIR] [key.sub=value ...]
    grpo-stream trainer --config C --run-dir DIR [key=value ...]
    grpo-stream sampler --config C --index I [--run-dir DIR] [key=value ...]
    grpo-stream ingest  --config C [key=value ...]                   (ingest.standalone)
    grpo-stream audit   RUN_DIR [--redis-url URL] [--group ID] [--json PATH]
    grpo-stream colocated --config C --run-dir DIR [key=value ...]   (weights.transport=local)
    grpo-stream eval    --config C [--split test] [--limit N] [--json PATH] [key=value ...]
    grpo-stream plan    --config C [--json PATH] [key=value ...]     (memory per device vs hardware:, before a run)
    grpo-stream devices --config C [--gpus N] [--compose] [key=value ...]   (each process's GPUs and memory settings)
    grpo-stream submit  FILE.jsonl [--follow] [--run-dir DIR | --address HOST:PORT] [--token-file F]
    grpo-stream status  [--run-dir DIR | --address HOST:PORT] [--token-file F]
    grpo-stream tokens  --out DIR
    grpo-stream config  describe [PREFIX]          (every field: type, default, limits, doc)
    grpo-stream config  show --config C [key=value ...]   (the resolved config, as `up` saves it)

Expected errors (a bad config, an unreachable service, a bad file) print one line; the full traceback goes to
RUN_DIR/error-COMMAND.log (or the temporary directory's grpo-stream-error-COMMAND.log without a run directory), and
`--debug` (before or after the command) prints it too.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time
import traceback

from grpo_stream.bench.runner import BENCHMARKS
from grpo_stream.submit_command import add_parsers as add_submit_parsers


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-stream", description="Asynchronous GRPO post-training: samplers "
                                     "stream rollout groups over gRPC into Redis; the trainer learns off-policy.")
    parser.add_argument("--debug", action="store_true", help="print full tracebacks of errors (they always go to "
                        "the run's error-COMMAND.log)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_parser = sub.add_parser

    def add_parser(name: str, **kwargs) -> argparse.ArgumentParser:  # every command also takes --debug after it
        p = _add_parser(name, **kwargs)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        return p

    sub.add_parser = add_parser

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", type=pathlib.Path, help="YAML run config (default: built-in defaults)")
        p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
        p.add_argument("-v", "--verbose", action="store_true", help="detail lines: every trainer step, every weight "
                       "version a sampler fetches and installs (logging.verbose=true)")
        p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted config overrides")

    up = sub.add_parser("up", help="run the whole loop locally: Redis, trainer and samplers as processes")
    common(up)
    up.add_argument("--run-dir", type=pathlib.Path, help="where logs, TensorBoard and summary.json go "
                    "(default runs/<run.name>-<time>)")
    tr = sub.add_parser("trainer", help="run the trainer (ingest + weights server, GRPO steps)")
    common(tr)
    tr.add_argument("--run-dir", type=pathlib.Path, required=False, help="output directory")
    sa = sub.add_parser("sampler", help="run one sampler (generation, rewards, rollout stream)")
    common(sa)
    sa.add_argument("--index", type=int, default=0, help="this sampler's index in 0..sampler.replicas-1 "
                    "(its data shard and id)")
    sa.add_argument("--run-dir", type=pathlib.Path, help="write sampler-<index>.json here at exit")
    ing = sub.add_parser("ingest", help="run the rollout ingest on its own (ingest.standalone): samplers keep "
                         "delivering into Redis while the trainer restarts")
    common(ing)
    au = sub.add_parser("audit", help="account for every accepted rollout group: trained once, dropped, waiting, "
                        "or lost / trained twice (exit 1)")
    au.add_argument("run_dir", type=pathlib.Path, help="a directory a trainer wrote (holds run.json)")
    au.add_argument("--redis-url", help="the run's Redis (default: the URL in run.json, else the run's own data in "
                    "RUN_DIR/redis)")
    au.add_argument("--group", help="print one group's history instead")
    au.add_argument("--json", type=pathlib.Path, help="where the report goes (default RUN_DIR/audit.json)")
    co = sub.add_parser("colocated", help="trainer and samplers in one JAX process with weights.transport=local "
                        "(what `up` runs then; also the single-controller mode on a TPU VM or Pathways)")
    common(co)
    co.add_argument("--run-dir", type=pathlib.Path, required=False, help="output directory")
    be = sub.add_parser("bench", help="benchmarks against baselines in the same run (writes JSON)")
    be.add_argument("name", choices=[*BENCHMARKS, "all"], help="which benchmark ('all': each in turn)")
    be.add_argument("--json", type=pathlib.Path, help="write the result here (for 'all': a directory, one NAME.json "
                    "each; default runs/bench)")
    be.add_argument("--table", type=pathlib.Path, default=pathlib.Path("runs/bench/results.md"),
                    help="markdown table to append a row to per benchmark (default runs/bench/results.md)")
    be.add_argument("--quick", action="store_true", help="a few seconds, only to check that it works")
    ev = sub.add_parser("eval", help="greedy pass@1, pass@k and maj@k of the config's model on a split")
    common(ev)
    ev.add_argument("--split", default="test", help="test (held-out, default) or train")
    ev.add_argument("--limit", type=_positive_int, help="problems to score (default eval.num_problems)")
    ev.add_argument("--json", type=pathlib.Path, help="write the result here")
    pl = sub.add_parser("plan", help="compile the run's trainer and sampler programs for the target device count "
                        "on CPU and report memory per device against hardware: (exit 1 when it does not fit)")
    common(pl)
    pl.add_argument("--json", type=pathlib.Path, help="also write the report here")
    dv = sub.add_parser("devices", help="which GPUs and memory settings each process of the run gets (as `up` gives "
                        "them), or compose/.env lines for them (--compose)")
    common(dv)
    dv.add_argument("--gpus", type=int, help="lay out on a host of this many GPUs (default: this host's, as `up`)")
    dv.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default: nvidia-smi's, or hardware:)")
    dv.add_argument("--compose", action="store_true", help="print compose/.env settings for this layout")
    dv.add_argument("--json", type=pathlib.Path, help="also write the plan here")
    add_submit_parsers(sub, common)
    cf = sub.add_parser("config", help="describe the config fields, or show a resolved config")
    cf_sub = cf.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    de = cf_sub.add_parser("describe", help="every field with its type, default, limits and documentation")
    de.add_argument("prefix", nargs="?", default="", help="only fields whose dotted name starts with this "
                    "(e.g. trainer. or weights.transport)")
    sh = cf_sub.add_parser("show", help="the resolved config (file, then overrides, then defaults) as YAML")
    common(sh)
    rep = sub.add_parser("report", help="PNG plots and a markdown summary of a run directory")
    rep.add_argument("run_dir", type=pathlib.Path, help="a directory written by `up` or `trainer`")
    return parser


def _error(args: argparse.Namespace, exc: BaseException, run_dir: pathlib.Path | None = None,
           what: str = "error") -> None:
    """One line for the user; the whole traceback in a file (and on stderr with --debug), never lost."""
    trace = "".join(traceback.format_exception(exc))
    if what == "config error":  # the user's input, named field and fix: the traceback would say nothing more
        if args.debug:
            print(trace, file=sys.stderr, end="")
        print(f"grpo-stream {args.command}: {what}: {exc}", file=sys.stderr)
        return
    name = f"error-{args.command}.log" if run_dir is not None else f"grpo-stream-error-{args.command}.log"
    path = (run_dir if run_dir is not None else pathlib.Path(tempfile.gettempdir())) / name
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(trace)
        where = f" (traceback in {path})"
    except OSError:
        where, args.debug = "", True  # nowhere to keep it: print it
    if args.debug:
        print(trace, file=sys.stderr, end="")
    print(f"grpo-stream {args.command}: {what}: {exc}{'' if args.debug else where}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    args.debug = args.debug or os.environ.get("GRPO_STREAM_DEBUG", "") not in ("", "0")
    if args.command == "bench":
        from grpo_stream.bench.runner import run_benchmarks

        return run_benchmarks(args.name, args.json, args.table, args.quick)
    if args.command == "report":
        from grpo_stream.report import make_report

        try:
            out = make_report(args.run_dir)
        except (FileNotFoundError, ValueError) as exc:
            _error(args, exc, args.run_dir if args.run_dir.is_dir() else None)
            return 1
        print(f"report written to {out}/report.md")
        return 0
    if args.command == "config":
        from grpo_stream.common.config.describe import describe
        from grpo_stream.common.config.loading import load_config, to_yaml
        from grpo_stream.common.config.schema import RunConfig

        try:
            if args.config_command == "describe":
                print(describe(RunConfig, args.prefix), end="")
            else:
                print(to_yaml(load_config(args.config, args.overrides)), end="")
        except ValueError as exc:  # ConfigError is a ValueError
            _error(args, exc, what="config error")
            return 2
        return 0
    if args.command in ("submit", "status", "tokens"):
        from grpo_stream.common.config.schema import ConfigError
        from grpo_stream.submit_command import run

        try:
            return run(args)
        except ConfigError as exc:
            _error(args, exc, what="config error")
            return 2
    if args.command == "audit":
        from grpo_stream.common.rollouts.redis_server import RedisConnectError
        from grpo_stream.audit import run_audit

        try:
            return run_audit(args.run_dir, args.redis_url, args.group, args.json)
        except (FileNotFoundError, ValueError, RedisConnectError) as exc:
            _error(args, exc, args.run_dir if args.run_dir.is_dir() else None)
            return 2
    from grpo_stream.common.config.loading import load_config, to_yaml
    from grpo_stream.common.config.schema import ConfigError

    if getattr(args, "verbose", False):
        args.overrides.append("logging.verbose=true")
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        _error(args, exc, what="config error")
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    import logging

    from grpo_stream.common.runtime.process import (compilation_cache_dir, enable_compilation_cache, import_tensorboardx_without_torch,
                                pin_to_cpus, setup_logging)

    log = logging.getLogger("grpo_stream.cli")
    if args.command == "eval":
        from grpo_stream.eval_command import run_eval

        setup_logging(cfg.logging.level, "eval", cfg.logging.format, cfg.logging.verbose)
        try:
            import_tensorboardx_without_torch()
            cache = enable_compilation_cache(cfg)
            doc = run_eval(cfg, args.split, args.limit, args.json)
        except (ValueError, OSError, RuntimeError) as exc:  # RuntimeError: XLA and device errors
            _error(args, exc)
            return 1
        log.info("%s", cache.summary())
        ks = ", ".join(f"pass@{k} {doc['pass_at_k'][k]:.3f}, maj@{k} {doc['maj_at_k'][k]:.3f}" for k in doc["pass_at_k"])
        print(f"{doc['split']}: {doc['num_problems']} problems, greedy pass@1 {doc['accuracy']:.3f}"
              + (f", {ks}" if ks else "") + (f"; wrote {args.json}" if args.json else ""))
        return 0
    if args.command == "plan":
        from grpo_stream.plan_command import run_plan

        setup_logging(cfg.logging.level, "plan", cfg.logging.format, cfg.logging.verbose)
        try:
            return run_plan(cfg, args.json)
        except ValueError as exc:  # a config plan cannot size: the field is named
            _error(args, exc, what="config error")
            return 2
        except (OSError, RuntimeError) as exc:
            _error(args, exc)
            return 2
    if args.command == "devices":
        from grpo_stream.devices_command import run_devices

        return run_devices(cfg, args.gpus, args.gpu_memory_gib, args.compose, args.json)
    if args.command == "up":
        from grpo_stream.up import run_up

        setup_logging(cfg.logging.level, "up", cfg.logging.format, cfg.logging.verbose)
        try:  # `up` compiles nothing itself; a bad cache directory stops it before any process starts
            compilation_cache_dir(cfg)
        except ValueError as exc:
            _error(args, exc)
            return 1
        run_dir = args.run_dir or pathlib.Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        return run_up(args.config, args.overrides, cfg, run_dir)
    setup_logging(cfg.logging.level, args.command if args.command != "sampler" else f"sampler-{args.index}",
                  cfg.logging.format, cfg.logging.verbose)
    from grpo_stream.common.runtime.parent_death import watch_parent

    watch_parent()  # a child of `up` stops when `up` is gone (common/runtime/parent_death.py)
    from grpo_stream.common.runtime.device_plan import device_env, own_process_env

    os.environ.update(own_process_env(cfg, args.command, os.environ))  # before JAX starts: it reads them once
    if device_env(os.environ):
        log.info("device settings: %s", " ".join(f"{k}={v}" for k, v in device_env(os.environ).items()))
    if cfg.run.deterministic:  # before JAX starts: XLA reads its flags once
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()
    if args.command == "ingest":  # no JAX in this process (Redis and gRPC only): no compilation cache
        from grpo_stream.trainer_service.ingest_server import run_ingest

        try:
            run_ingest(cfg)
        except (ValueError, OSError, RuntimeError) as exc:
            _error(args, exc)
            return 1
        return 0
    try:
        pin_to_cpus(*((cfg.sampler.cpu_affinity, "sampler.cpu_affinity") if args.command == "sampler" else
                      (cfg.trainer.cpu_affinity, "trainer.cpu_affinity")))
        import_tensorboardx_without_torch()
        cache = enable_compilation_cache(cfg)
        from grpo_stream.common.model.sharding import initialize_distributed

        initialize_distributed(cfg.distributed.initialize)
        if args.command == "colocated":
            from grpo_stream.colocated import run_colocated

            run_dir = args.run_dir or pathlib.Path("runs") / cfg.run.name
            run_dir.mkdir(parents=True, exist_ok=True)
            run_colocated(cfg, run_dir)
        elif args.command == "trainer":
            from grpo_stream.trainer_service.loop import run_trainer

            run_dir = args.run_dir or pathlib.Path("runs") / cfg.run.name
            run_dir.mkdir(parents=True, exist_ok=True)
            run_trainer(cfg, run_dir)
        else:
            from grpo_stream.sampler_service.loop import run_sampler

            run_sampler(cfg, args.index, args.run_dir)
    except (ValueError, ConnectionError, OSError, RuntimeError) as exc:  # RedisConnectError is a RuntimeError;
        _error(args, exc, getattr(args, "run_dir", None))  # XLA and device errors too: their traceback is kept
        return 1
    log.info("%s", cache.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
