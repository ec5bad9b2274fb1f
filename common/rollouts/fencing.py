"""The fencing number every trainer write carries (the lease that hands fences out: trainer_lease.py): the check the
Lua scripts make first, and the error a write of a stale trainer meets."""

from __future__ import annotations

STALE_CODE = "STALETRAINER"

# Why a trainer's fence is not the run's when the run has none: no newer trainer took it (each start sets one), the
# key is gone, and with it, most likely, everything this trainer wrote there
# (no quote characters: it is spliced into a Lua string)
LOST_FENCE = ("the run has no fence at all: Redis lost the keys of this run (restarted without its append-only file, "
              "or they were deleted), and with them the groups and records this trainer wrote there; check the "
              "persistence of the Redis server, then start the trainer again (it resumes from its last checkpoint)")

# The check every trainer write makes first; `fence` '' (a standalone ingest, a test's buffer) is not checked.
FENCE_LUA = """
local function stale(key, fence)
  if fence == '' then return nil end
  local current = redis.call('GET', key)
  if current == fence then return nil end
  if not current then
    return redis.error_reply('""" + STALE_CODE + """ this trainer holds fence ' .. fence .. ' but '
      .. '""" + LOST_FENCE + """')
  end
  return redis.error_reply('""" + STALE_CODE + """ this trainer holds fence ' .. fence .. ' but the run is at fence '
    .. current .. ': a newer trainer took the run over')
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
