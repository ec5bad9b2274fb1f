"""What the client commands say when the PromptService answers with an error, worded by its status code.

The CLI's exit-code policy (grpo_stream/cli.py) reads the exception type: a ValueError is input the command cannot
use (exit 2: a refused prompt, an unknown id, a token that may not do this), anything else a runtime failure that a
retry may fix (exit 1: a full queue, a server down). The gRPC error stays chained (`raise ... from`) in the
traceback file.
"""

from __future__ import annotations

import pathlib
import re

import grpc

# the server refused the request itself: the same request is refused again (exit 2)
INPUT_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})
# answered with a refusal of the whole call (a Submit is all or nothing): nothing of it was done
REFUSAL_CODES = INPUT_CODES | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION}

# what PromptService names when the queue or a client's quota is full (prompt_queue.QueueFull)
QUEUE_SETTINGS = ("prompts.max_queued", "prompts.max_pending_per_client")


def is_refusal(exc: BaseException) -> bool:
    return isinstance(exc, grpc.RpcError) and exc.code() in REFUSAL_CODES


def is_too_large(exc: BaseException) -> bool:
    """A message over a gRPC size limit (this client's "Sent message larger than max", or the server's "Received
    ..."): RESOURCE_EXHAUSTED like a full queue, but the same request never fits, so retrying it is no use."""
    return (isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "message larger than max" in (exc.details() or ""))


# PromptService's words for a call that a limit refuses by its own size (prompt_queue.QueueFull): "(SETTING=N); K more
# exceed it" / "do not fit"
_OVER_LIMIT = re.compile(r"\((prompts\.max_pending_per_client|prompts\.max_queued)=(\d+)\); (\d+) more")


def never_fits(exc: BaseException) -> tuple[str, int] | None:
    """(setting, limit) when `exc` refuses a Submit of more prompts than the queue or the client's quota can hold at
    all: RESOURCE_EXHAUSTED like a full one, but no prompt finishing makes room for it, so it is not retried."""
    if not (isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED):
        return None
    match = _OVER_LIMIT.search(exc.details() or "")
    return (match[1], int(match[2])) if match and int(match[3]) > int(match[2]) else None


def at_lines(details: str, chunk: list[tuple[int, object]], path: pathlib.Path) -> str:
    """The server's `prompts[i]` (the index in one Submit call) as FILE:LINE, the line the user edits: blank lines
    and earlier calls make the two differ."""
    def line(match: re.Match) -> str:
        i = int(match[1])
        return f"{path}:{chunk[i][0]}: " if i < len(chunk) else match[0]
    return re.sub(r"prompts\[(\d+)\]\.?", line, details)


def explain(exc: grpc.RpcError, address: str, where=lambda details: details) -> Exception:
    """The error to raise for `exc` from the server at `address`; `where` rewrites the server's details (at_lines)."""
    code, details = exc.code(), where(exc.details() or "")
    if is_too_large(exc):
        return ValueError(f"{code.name}: the request is over the gRPC message limit ({details}); send fewer or "
                          "shorter prompts per call (`submit --batch`)")
    if over := never_fits(exc):
        return ValueError(f"{code.name}: {details}; one call holds more prompts than {over[0]}={over[1]} allows at "
                          f"once, so it never fits: give --batch at most {over[1]}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not any(setting in details for setting in QUEUE_SETTINGS):
        # the server's call limits (common/rpc/call_guard.py), whose details name the setting: not the queue
        return RuntimeError(f"{code.name}: the server has no room for this call now ({details}); retry later")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RuntimeError(f"{code.name}: the run's prompt queue or this client's quota of unfinished prompts is "
                            f"full ({details}); retry later, or wait for (or cancel) your unfinished prompts")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return RuntimeError(f"{code.name}: no answer from {address} ({details}): is a run listening there? Check "
                            "--address or --run-dir (`grpo-stream up` writes RUN_DIR/endpoints.json), or give a "
                            "service still starting more --wait")
    if code in INPUT_CODES:
        return ValueError(f"{code.name}: {details}")
    return RuntimeError(f"{code.name}: {details}")
