"""Permanent and transient failures, and the exit codes every entry point uses.

A retry loop (common/runtime/backoff.py) retries only what a later attempt can fix: a server that is down or
restarting, a connection reset, a deadline passed. A sampler started with another model's weights, a config the
trainer refuses, a checkpoint of the wrong shape stay wrong however often they are retried: those are permanent.
A process that meets a permanent failure exits with `EXIT_PERMANENT` after writing `RUN_DIR/failures/NAME.json`,
and `up` stops the run there, saying which process failed and why, instead of restarting it into the same wall.

Exit codes (the CLI's one policy, grpo_stream/cli.py):
  0    done
  1    a runtime failure that a restart may fix (a supervisor restarts the process)
  2    usage or config error (nothing ran)
  3    a permanent runtime failure: restarting cannot help (up stops the run)
  130  interrupted (SIGINT/SIGTERM)
"""

from __future__ import annotations

import json
import pathlib
import time

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_PERMANENT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
FAILURES_DIR = "failures"  # RUN_DIR/failures/NAME.json: what made process NAME exit permanently


class PermanentError(RuntimeError):
    """A failure that no retry can fix (wrong model shapes, a refused config, an incompatible peer). Its message
    says what is wrong and what to change."""


class SetupError(PermanentError, ValueError):
    """A run's task, tokenizer or model that cannot be built from its config and files (a malformed model.path, a
    tokenizer without a pad token, a prompt template the task or tokenizer does not take): every restart would fail
    the same way. A ValueError too, for the handlers that read bad input as one."""


class TransientError(RuntimeError):
    """A failure a later attempt may not meet (a peer down or restarting, a deadline passed)."""


# gRPC status codes whose failure a later call may not meet; every other code (INVALID_ARGUMENT,
# FAILED_PRECONDITION, PERMISSION_DENIED, UNAUTHENTICATED, UNIMPLEMENTED, ...) repeats on every retry
TRANSIENT_GRPC = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED", "CANCELLED",
                            "UNKNOWN", "INTERNAL"})


def is_transient(exc: BaseException) -> bool:
    """Whether retrying what raised `exc` can succeed. Explicit classes decide first; then gRPC status codes,
    Redis and socket errors (a peer unreachable) are transient; anything else (a ValueError from validation, a
    shape mismatch, a KeyError) is a bug or a wrong setting and is permanent."""
    if isinstance(exc, PermanentError):
        return False
    if isinstance(exc, TransientError):
        return True
    code = getattr(exc, "code", None)
    if callable(code):  # grpc.RpcError (without importing grpc here)
        try:
            name = getattr(code(), "name", "")
        except Exception:  # noqa: BLE001 - an RpcError without a status: the channel broke
            return True
        return name in TRANSIENT_GRPC
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    module = type(exc).__module__ or ""
    if module.startswith("redis"):  # redis.exceptions.ConnectionError/TimeoutError/BusyLoadingError ...
        return type(exc).__name__ in {"ConnectionError", "TimeoutError", "BusyLoadingError", "TryAgainError",
                                      "ClusterDownError", "ReadOnlyError"}
    return isinstance(exc, OSError) and not isinstance(exc, (FileNotFoundError, PermissionError,
                                                             IsADirectoryError, NotADirectoryError))


def failure_path(run_dir: pathlib.Path | str, process: str) -> pathlib.Path:
    return pathlib.Path(run_dir) / FAILURES_DIR / f"{process}.json"


def record_permanent(run_dir: pathlib.Path | str | None, process: str, exc: BaseException) -> None:
    """Write why `process` stops for good, for `up` (and a reader of RUN_DIR) to report; never raises (the
    process is already failing, and its log line says the same)."""
    if run_dir is None:
        return
    try:
        path = failure_path(run_dir, process)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"process": process, "error": type(exc).__name__, "message": str(exc),
                                   "time": time.time()}))
        tmp.replace(path)
    except OSError:
        pass


def read_permanent(run_dir: pathlib.Path | str, process: str) -> dict | None:
    """What `record_permanent` wrote for `process`, or None (nothing, or not readable as a record)."""
    try:
        record = json.loads(failure_path(run_dir, process).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("message"), str) else None


def clear_permanent(run_dir: pathlib.Path | str, process: str) -> None:
    """Before (re)starting `process`: an old record must not speak for the new attempt."""
    failure_path(run_dir, process).unlink(missing_ok=True)
