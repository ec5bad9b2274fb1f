"""The trainer's lease on a run's buffer, with a fencing number: one trainer writes a run at a time.

Every trainer of a run reads as the one consumer `trainer-0`, so two trainers on one run (a second `up` on the same
run, a Kubernetes pod restarted while the old one still terminates, a trainer paused or cut off from Redis while a
new one started) would read the same groups, train them both, and both write the audit trail. So:

- Each trainer start takes the lease P:R:trainer:lease (a value naming the holder, with a TTL of
  trainer.lease_ttl_s) and raises the fencing number P:R:trainer:fence (never expires) to at least the server's
  clock in ms (TAKE: a number is never handed out twice, even by a Redis that lost the key). It waits while a live
  trainer holds the lease; a holder on this machine whose process is gone (a kill -9) is taken over at once, one
  elsewhere when its lease expires.
- A thread renews the lease every third of its TTL while the trainer runs. A lease that lapsed (Redis away, the
  process paused) is taken again as long as the fence is still this trainer's.
- Every write a trainer makes carries its fence: appends of its ingest, settles, step/start/checkpoint records, the
  held count, audit compaction. The Lua scripts (buffer_scripts.py) compare it with P:R:trainer:fence and refuse a
  stale one with a STALETRAINER error; the trainer then stops at once, writing nothing more (no checkpoint either:
  the newer trainer owns the run). Its unsettled groups stay pending in the stream for the newer trainer.

A standalone ingest writes with no fence (it is not a trainer; appends are de-duplicated by group id).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from typing import Callable

import redis

from grpo_stream.common.runtime.backoff import Backoff, StopRequested, wait
from grpo_stream.common.runtime.errors import PermanentError
from grpo_stream.common.rollouts.fencing import FENCE_LUA, StaleTrainer, is_stale_reply
from grpo_stream.common.rollouts.redis_errors import BufferUnavailable, DamagedRecord, redis_call, wrong_type

log = logging.getLogger(__name__)

EXIT_FENCED = 3  # the exit code of a trainer stopped because a newer one took its run over

# KEYS: lease, fence. ARGV: holder (JSON), TTL ms, the value of a lease whose holder is known to be dead ('' none).
# Returns {1, value, fence} when taken, else {0, the holder's value, its remaining TTL in ms}.
# The new fence is above the last one and at least the server's clock in ms: a Redis that lost the fence key (a
# restart without its append-only file, an older snapshot restored) would otherwise count from 1 again and hand a
# new trainer the very number a running older one holds, whose writes would then all pass the check.
TAKE = """
redis.replicate_commands()
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[3] then
  return {0, current, redis.call('PTTL', KEYS[1])}
end
local last = redis.call('GET', KEYS[2])
-- at most 15 digits: Lua numbers are doubles, and past 2^53 adding 1 may give the same number (a fence handed out
-- twice) or, formatted with %d, a negative one (fences are ms since the epoch: 13 digits)
if last and not (string.match(last, '^%d+$') and #last <= 15) then
  return redis.error_reply('DAMAGEDBUFFER ' .. KEYS[2] .. ' holds ' .. string.format('%q', string.sub(last, 1, 40))
    .. ', not a fencing number; no trainer can take the run. If no trainer of this run is running, delete it '
    .. '(redis-cli DEL ' .. KEYS[2] .. ') and start the trainer again')
end
local now = redis.call('TIME')
local fence = math.max(tonumber(last or '0') + 1, tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
fence = string.format('%d', fence)
redis.call('SET', KEYS[2], fence)
local value = fence .. ' ' .. ARGV[1]
redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
return {1, value, fence}
"""

RENEW = FENCE_LUA + """
local refused = stale(KEYS[2], ARGV[1])
if refused then return refused end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""

RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def fenced_exit(message: str) -> None:
    """Stop this trainer process at once: a stale trainer must not write anything more, not even a checkpoint."""
    log.critical("%s; stopping now without writing anything more (the newer trainer goes on with this run's groups)",
                 message)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    os._exit(EXIT_FENCED)


def this_process() -> dict:
    """Who holds a lease: enough to tell, on the same machine and pid namespace, whether that process still runs."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot": _read("/proc/sys/kernel/random/boot_id"),
            "pidns": _link("/proc/self/ns/pid"), "start": _start_ticks(os.getpid()), "t": round(time.time(), 1)}


def holder_is_gone(holder: dict) -> bool:
    """True only when the holder ran on this machine, in this pid namespace, and its process no longer exists (or
    its pid now belongs to a process started at another time)."""
    me = this_process()
    if not me["boot"] or not me["pidns"] or holder.get("boot") != me["boot"] or holder.get("pidns") != me["pidns"]:
        return False
    pid = holder.get("pid")
    return not isinstance(pid, int) or _start_ticks(pid) != holder.get("start")


def parse_value(value: str) -> tuple[int, dict | None]:
    """(fence, holder) of a lease value 'FENCE JSON-OBJECT'; (-1, None) for a value no trainer wrote."""
    fence, _, holder = value.partition(" ")
    try:
        fence_number, parsed = int(fence), json.loads(holder)
    except (ValueError, RecursionError):  # nested past the parser's depth: no trainer wrote it either
        return -1, None
    return (fence_number, parsed) if isinstance(parsed, dict) else (-1, None)


class LeaseDamaged(PermanentError):
    """The run's lease key holds what no trainer writes (no TTL, or not 'FENCE HOLDER'): waiting would never end."""


class TrainerLease:
    """This trainer's lease and fence on the run of `buffer` (a RedisStreamBuffer); see the module docstring."""

    def __init__(self, buffer, ttl_s: float, on_stale: Callable[[str], None] = fenced_exit):
        self.buffer, self.client, self.ttl_s, self.on_stale = buffer, buffer.client, ttl_s, on_stale
        self.lease_key, self.fence_key = buffer.k["trainer:lease"], buffer.k["trainer:fence"]
        self.fence, self.value = -1, ""
        self._take, self._renew = self.client.register_script(TAKE), self.client.register_script(RENEW)
        self._release = self.client.register_script(RELEASE)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def take(cls, buffer, ttl_s: float, stop: threading.Event | None, on_stale: Callable[[str], None] = fenced_exit,
             renew: bool = True) -> "TrainerLease":
        """Take the run's lease (waiting while a live trainer holds it; StopRequested when `stop` is set first),
        fence the buffer's writes with the new fencing number and, with `renew`, keep the lease renewed."""
        lease = cls(buffer, ttl_s, on_stale)
        lease._acquire(stop)
        buffer.use_fence(str(lease.fence), on_stale)
        if renew:
            lease._thread = threading.Thread(target=lease._renew_loop, name="trainer-lease", daemon=True)
            lease._thread.start()
        return lease

    def _acquire(self, stop: threading.Event | None) -> None:
        backoff, dead, noted = Backoff(0.2, 2.0), "", 0.0
        holder_json = json.dumps({**this_process(), "take": secrets.token_hex(8)})  # names this call
        while True:
            if stop is not None and stop.is_set():
                raise StopRequested(f"stopped while waiting for the trainer lease of run {self.buffer.run_name}")
            try:
                taken, value, extra = redis_call(lambda: self._take(
                    keys=[self.lease_key, self.fence_key], args=[holder_json, int(self.ttl_s * 1000), dead]))
            except BufferUnavailable as exc:
                delay = backoff.next()
                log.error("taking the trainer lease: Redis unavailable (%s); retrying in %.1fs", exc, delay)
                wait(delay, stop)
                continue
            except redis.ResponseError as exc:  # a lease or fence no trainer wrote: no retry mends it
                raise self._damaged_key(exc) from None
            value = _text(value)
            if int(taken):
                self.fence, self.value = int(extra), value
                log.info("trainer lease of run %s taken: fence %d%s", self.buffer.run_name, self.fence,
                         " (its previous holder's process was gone, or a lost reply's take)" if dead else "")
                return
            fence, holder = parse_value(value)
            # this very call's own lease (holder_json names the call), taken by a try whose reply was lost (Redis ran
            # the script, the connection dropped before its reply; the take was tried again): not another trainer to
            # wait the whole TTL for, saying another trainer runs this run
            if holder is not None and (value.partition(" ")[2] == holder_json or holder_is_gone(holder)):
                dead = value  # taken over at the next try, only if the lease still holds this very value
                continue
            self._refuse_damaged(value, holder, int(extra))
            if time.monotonic() - noted > max(10.0, self.ttl_s):
                noted = time.monotonic()
                log.warning("run %s: trainer lease held by fence %d (pid %s on %s), %.1fs left unless renewed: "
                            "another trainer runs this run; waiting for it to stop", self.buffer.run_name, fence,
                            holder.get("pid"), holder.get("host"), int(extra) / 1000)
            wait(min(max(int(extra), 100) / 1000, self.ttl_s / 3), stop)

    def _refuse_damaged(self, value: str, holder: dict | None, pttl_ms: int) -> None:
        """LeaseDamaged for a lease no trainer wrote: every trainer sets a TTL (a live one renews it), so one without
        (PTTL -1) never ends by itself, and a value that is not 'FENCE HOLDER' names no process to wait for. Not
        taken over: whoever wrote it may be a trainer of another version still writing this run."""
        if holder is not None and pttl_ms != -1:
            return  # a live trainer's lease: wait for it
        problem = (f"holds {value[:80]!r}, not a trainer's 'FENCE HOLDER' value" if holder is None
                   else f"holds {value[:80]!r} with no expiry (a trainer's lease always has one)")
        raise LeaseDamaged(f"run {self.buffer.run_name}: the trainer lease {self.lease_key} {problem}, so no "
                           f"trainer can take the run. If no trainer of this run is running, delete it (redis-cli "
                           f"DEL {self.lease_key}) and start the trainer again")

    def _damaged_key(self, exc: redis.ResponseError) -> Exception:
        """LeaseDamaged (permanent: `up` stops the run naming it, not restarting a trainer that cannot start) for
        a fence that is no number (TAKE's DAMAGEDBUFFER) or a lease or fence key of another type than a string (a
        bare WRONGTYPE named neither key); `exc` itself for any other refusal."""
        if "DAMAGEDBUFFER" in str(exc):
            return LeaseDamaged(f"run {self.buffer.run_name}: {exc}")
        found = redis_call(lambda: wrong_type(self.client, exc, {self.lease_key: "string", self.fence_key: "string"}))
        if not isinstance(found, DamagedRecord):
            return found
        key = self.lease_key if str(found).startswith(self.lease_key) else self.fence_key
        return LeaseDamaged(f"run {self.buffer.run_name}: {found}; no trainer can take the run. If no trainer of this "
                            f"run is running, delete it (redis-cli DEL {key}) and start the trainer again")

    def renew(self) -> None:
        """Extend the lease (taking it again if it lapsed); StaleTrainer when a newer trainer has the run."""
        try:
            redis_call(lambda: self._renew(keys=[self.lease_key, self.fence_key],
                                           args=[self.fence, self.value, int(self.ttl_s * 1000)]))
        except Exception as exc:  # noqa: BLE001 - only the fence's refusal is turned into StaleTrainer
            if is_stale_reply(exc):
                raise StaleTrainer(f"trainer lease of run {self.buffer.run_name}: {exc}") from None
            raise

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.renew()
            except BufferUnavailable as exc:  # the lease may lapse; the fence still holds until another start
                log.warning("renewing the trainer lease: Redis unavailable (%s)", exc)
            except StaleTrainer as exc:
                self.on_stale(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - the renewal outlives a surprise; the writes still check the fence
                log.error("renewing the trainer lease failed: %s: %s", type(exc).__name__, exc)

    def release(self) -> None:
        """Stop renewing and let the next trainer take the lease at once (the fence stays: it only grows)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            redis_call(lambda: self._release(keys=[self.lease_key], args=[self.value]))
        except BufferUnavailable as exc:  # it expires by itself
            log.warning("releasing the trainer lease: Redis unavailable (%s); it expires in %.0fs", exc, self.ttl_s)


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None when it is gone or a
    zombie (dead, not yet reaped)."""
    fields = _read(f"/proc/{pid}/stat").rpartition(")")[2].split()
    try:
        return None if fields[0] == "Z" else int(fields[19])
    except (IndexError, ValueError):
        return None

