"""The fencing number every trainer write carries (the lease that hands fences out: trainer_lease.py): the check the
Lua scripts make first, and the error a write of a stale trainer meets."""

from __future__ import annotations

STALE_CODE = "STALETRAINER"

# The check every trainer write makes first; `fence` '' (a standalone ingest, a test's buffer) is not checked.
FENCE_LUA = """
local function stale(key, fence)
  if fence == '' then return nil end
  local current = redis.call('GET', key)
  if current == fence then return nil end
  return redis.error_reply('""" + STALE_CODE + """ this trainer holds fence ' .. fence .. ' but the run is at fence '
    .. (current or 'none') .. ': a newer trainer took the run over')
end
"""

# A single command (XADD, SET) on KEYS[2], made only by the current trainer. ARGV: fence, command, its arguments.
FENCED_CALL = FENCE_LUA + """
local refused = stale(KEYS[1], ARGV[1])
if refused then return refused end
return redis.call(ARGV[2], KEYS[2], unpack(ARGV, 3))
"""

# Only the check: what a trainer runs right before a write outside Redis (a checkpoint). KEYS[1]: fence key.
FENCE_CHECK = FENCE_LUA + """
local refused = stale(KEYS[1], ARGV[1])
if refused then return refused end
return 1
"""


class StaleTrainer(RuntimeError):
    """A newer trainer took this trainer's run over (its fence is not the run's): this one must stop."""


def is_stale_reply(exc: BaseException) -> bool:
    return STALE_CODE in str(exc)
