"""Which Redis failures mean "unavailable, back off and try again": one rule for every caller of Redis.

The buffer, the prompt queue, the ingest's health watch and the trainer's status writer all call Redis; each
of them used to decide on its own which errors were passing, and the copies drifted (one missed replies sent
while a restarted Redis replays its AOF, none knew out-of-memory). What counts as passing here:

- no connection, a timeout, or a reply a server sends while it cannot serve yet: LOADING (replaying its AOF or
  RDB after a restart), MASTERDOWN (a replica that lost its primary);
- OOM: the server is at `maxmemory` and refuses writes (under `noeviction`, the only safe policy for the
  buffer); the writer must wait until the trainer settles groups or an operator adds memory, never crash (the
  trainer's own records refused so first settle what they may: `is_out_of_memory`, checkpoints/durability.py);
- READONLY: a replica answered (a failover under way, or the URL names a replica); writes succeed once the
  URL reaches a primary again.

redis-py maps some of these to classes (BusyLoadingError, OutOfMemoryError, ReadOnlyError), but an error raised
by a command inside a Lua script reaches the client as a plain ResponseError whose text carries the code after a
'-' (e.g. "... @user_script:12: -OOM command not allowed ..."), so the codes are matched in the text too.
Every other error (a wrong type, a script bug, a refused password) is a real fault and propagates.
"""

from __future__ import annotations

import re
from typing import Callable, TypeVar

import redis

T = TypeVar("T")

PASSING_CODES = ("LOADING", "MASTERDOWN", "OOM", "READONLY")
_PASSING_CLASSES = (redis.exceptions.BusyLoadingError, redis.exceptions.MasterDownError,
                    redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)
# where Redis puts a code: at the start, after a Lua script's "@user_script:N: -" (Redis 6) or after a pipeline's
# "caused error: " (redis-py). Not after any ':' or '-': run names ([A-Za-z0-9_.-]) and sampler ids may hold these
# words, and a damaged record's message names its key ('grpo-stream:OOM-repro:counters' was read as an OOM and
# retried for ever)
_PASSING = re.compile(r"(?:^|:\s-?)(" + "|".join(PASSING_CODES) + r")\b")
# the buffer's own refusals (the scripts' error replies): faults whatever key or value their message quotes
OWN_CODES = ("DAMAGEDBUFFER", "STALETRAINER")


class BufferUnavailable(Exception):
    """The backend cannot be reached or cannot take writes right now; nothing was written. Back off and retry."""


def is_unavailable(exc: BaseException) -> bool:
    """True when `exc` is a Redis failure that passes (see the module's docstring); False for real faults."""
    if isinstance(exc, (redis.exceptions.AuthenticationError, redis.exceptions.AuthorizationError)):
        return False  # ConnectionErrors to redis-py, but a wrong password or ACL is fixed by an operator, not time
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, *_PASSING_CLASSES)):
        return True
    # the parser strips a known code from the text of its class's errors, but not from a script's error
    return isinstance(exc, redis.ResponseError) and not str(exc).startswith(OWN_CODES) \
        and bool(_PASSING.search(str(exc)))


def is_out_of_memory(exc: BaseException) -> bool:
    """True when `exc` (or the Redis error a BufferUnavailable carries) is a write refused at `maxmemory`: what only
    deleting data mends, unlike the other passing failures, which time mends."""
    cause = exc.__cause__ if isinstance(exc, BufferUnavailable) and exc.__cause__ is not None else exc
    if isinstance(cause, redis.exceptions.OutOfMemoryError):
        return True
    match = _PASSING.search(str(cause)) if isinstance(cause, redis.ResponseError) else None
    return match is not None and match.group(1) == "OOM"


def redis_call(fn: Callable[[], T]) -> T:
    """fn(), with a passing Redis failure raised as BufferUnavailable (its text kept) and any other one as is."""
    try:
        return fn()
    except redis.RedisError as exc:
        if is_unavailable(exc):
            raise BufferUnavailable(f"redis: {exc}") from exc
        raise


# What a count the buffer keeps may hold: an integer as Redis writes one, with at most 18 digits (so adding to it stays
# within int64). HINCRBY refuses '007', '-0', '+5', ' 5' and '1_000', which Python's int() or Lua's tonumber() read
# (tonumber also '1e400', '0x10', 'inf'): a check looser than HINCRBY's passed them, and the write then failed half-way.
COUNT_LUA = """
local function is_count(raw)
  if raw == '0' then return true end
  local digits = string.match(raw, '^%-?([1-9]%d*)$')
  return digits ~= nil and #digits <= 18
end
"""
_COUNT = re.compile(r"0|-?[1-9][0-9]{0,17}")


def is_count(raw: str) -> bool:
    """COUNT_LUA's is_count: whether `raw` is an integer Redis can count on (HINCRBY)."""
    return _COUNT.fullmatch(raw) is not None


class DamagedRecord(ValueError):
    """A buffer key holds what grpo-stream never writes there (a hand edit, another tool, a partial restore); the
    message names the key and field and the command that restores it. Time does not mend it, unlike the above."""


def integer_of(raw, key: str, field: str | None = None) -> int:
    """`raw` (HGET `key` `field`, or GET `key` without a field) as an integer, or DamagedRecord naming them."""
    try:
        return int(raw)
    except (TypeError, ValueError):
        shown = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        where, fix = (key, f"SET {key} N") if field is None else (f"{key} field {field}", f"HSET {key} {field} N")
        raise DamagedRecord(f"{where} holds {shown[:40]!r}, not an integer (something other than grpo-stream wrote "
                            f"it); restore it: {fix}") from None


def wrong_type(client, exc: redis.ResponseError, kinds: dict[str, str]) -> Exception:
    """`exc` (a command refused WRONGTYPE) as DamagedRecord naming the first of `kinds` (key -> the type grpo-stream
    keeps there) that holds another type; `exc` itself for any other refusal. Redis names no key in WRONGTYPE."""
    if "WRONGTYPE" not in str(exc):
        return exc
    for key, kind in kinds.items():
        found = client.type(key)
        found = found.decode() if isinstance(found, bytes) else str(found)
        if found not in (kind, "none"):
            return DamagedRecord(f"{key} is a {found}, not the {kind} the rollout buffer keeps there (something other "
                                 "than grpo-stream wrote it); restore the key")
    return exc
