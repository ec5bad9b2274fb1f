"""The data positions a sampler's compacted watermark passed over without ever accepting a group there ("holes").

Audit compaction (audit_compaction.py) folds a sampler's settled groups into counts up to a data position, the
watermark `below:<sampler>`, and the ingest's append then answers a group at or below it `dup` (its accepted record,
the de-duplication set, is gone). But positions need not arrive in order: a sampler's backlog resent after an
outage, or a group refused `full` and sent again later, can arrive after groups of later positions were trained and
compacted. Such a position was never accepted, so answering it `dup` would tell its sampler it was delivered while
it is never trained nor counted. So compaction records the positions its watermark jumps over, per sampler, as
intervals in P:R:audit:compacted (`holes:<sampler>` = "lo-hi,lo-hi,..."), and a group at one of them is accepted
like any other (its interval shrinks). Positions a sampler skipped for good (an over-long prompt, a backlog lost to a
kill -9) stay holes; at most MAX_HOLES intervals are kept per sampler, the lowest going first: a group that late
would be far past max_staleness anyway.
"""

from __future__ import annotations

from grpo_stream.common.rollouts.redis_errors import COUNT_LUA

MAX_HOLES = 1024

# compacted_position(key, sampler, position): 'dup' for a position at or below the sampler's watermark that is no
# hole, 'hole' for one that is, nil above the watermark (or for no position). fill_hole: the position was accepted.
# damaged_below(key, sampler): an error naming the field when the watermark is no integer (checked before any write;
# read as absent, every compacted group of that sampler sent again would be trained twice; read by tonumber, '1e400'
# answered every later group dup). Coded DAMAGEDBUFFER, the code the ingest turns into FAILED_PRECONDITION.
HOLES_LUA = COUNT_LUA + """
local function damaged_below(key, sampler)
  local raw = redis.call('HGET', key, 'below:' .. sampler)
  if raw == false or is_count(raw) then return nil end
  return redis.error_reply('DAMAGEDBUFFER ' .. key .. ' field below:' .. sampler .. ' holds ' .. string.format('%q',
    string.sub(raw, 1, 40)) .. ', not a data position, so groups of sampler ' .. sampler .. ' cannot be checked for '
    .. 'second copies; nothing was written. Restore the highest compacted data position of that sampler (HSET '
    .. key .. ' below:' .. sampler .. ' N), or HDEL the field if none of its groups was ever compacted')
end
local function compacted_position(key, sampler, position)
  if position < 0 or position > (tonumber(redis.call('HGET', key, 'below:' .. sampler) or '-1') or -1) then
    return nil
  end
  local holes = redis.call('HGET', key, 'holes:' .. sampler)
  if holes then
    for lo, hi in string.gmatch(holes, '(%d+)-(%d+)') do
      if tonumber(lo) <= position and position <= tonumber(hi) then return 'hole' end
    end
  end
  return 'dup'
end
local function fill_hole(key, sampler, position)
  local field, kept = 'holes:' .. sampler, {}
  for lo, hi in string.gmatch(redis.call('HGET', key, field) or '', '(%d+)-(%d+)') do
    lo, hi = tonumber(lo), tonumber(hi)
    if lo <= position and position <= hi then
      if lo < position then kept[#kept + 1] = string.format('%d-%d', lo, position - 1) end
      if position < hi then kept[#kept + 1] = string.format('%d-%d', position + 1, hi) end
    else
      kept[#kept + 1] = string.format('%d-%d', lo, hi)
    end
  end
  if #kept == 0 then redis.call('HDEL', key, field) else redis.call('HSET', key, field, table.concat(kept, ',')) end
end
"""


def parse(text: str | None) -> list[tuple[int, int]]:
    if not text:
        return []
    return [(int(lo), int(hi)) for lo, hi in (part.split("-") for part in text.split(","))]


def render(holes: list[tuple[int, int]]) -> str:
    return ",".join(f"{lo}-{hi}" for lo, hi in holes)


def passed_over(old_below: int, positions: list[int]) -> list[tuple[int, int]]:
    """The intervals of positions above `old_below` that a watermark moving through the sorted compacted
    `positions` jumps over."""
    gaps, expected = [], old_below + 1
    for position in positions:
        if position > expected:
            gaps.append((expected, position - 1))
        expected = max(expected, position + 1)
    return gaps


def updated(existing: str | None, new: list[tuple[int, int]], filled: list[int]) -> str:
    """`existing` holes (as stored) with `new` ones, the lowest beyond MAX_HOLES dropped, and without the `filled`
    positions (accepted since: compaction writes what it read, and must not restore a hole an append filled)."""
    holes = {"": render(sorted(parse(existing) + new)[-MAX_HOLES:])}
    for position in filled:
        fill_hole(holes, "", position)
    return holes.get("", "")


def compacted_position(below: dict[str, int], holes: dict[str, str], sampler: str, position: int) -> str | None:
    """HOLES_LUA's compacted_position for the in-memory buffer."""
    if position < 0 or position > below.get(sampler, -1):
        return None
    return "hole" if any(lo <= position <= hi for lo, hi in parse(holes.get(sampler))) else "dup"


def fill_hole(holes: dict[str, str], sampler: str, position: int) -> None:
    """HOLES_LUA's fill_hole for the in-memory buffer."""
    kept = []
    for lo, hi in parse(holes.get(sampler)):
        if lo <= position <= hi:
            kept += [(lo, position - 1)] * (lo < position) + [(position + 1, hi)] * (position < hi)
        else:
            kept.append((lo, hi))
    if kept:
        holes[sampler] = render(kept)
    else:
        holes.pop(sampler, None)
