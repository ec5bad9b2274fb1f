"""The rollout buffer's two Lua scripts (common/rollouts/buffer.py runs them): appending a batch and settling
entries, each atomic in Redis. The key layout they work on is in buffer.py's docstring. Both first check the
writer's fencing number (trainer_lease.py): a trainer that a newer one took the run from writes nothing."""

from grpo_stream.common.rollouts.compaction_holes import HOLES_LUA
from grpo_stream.common.rollouts.kept_results import FINISH_PROMPT_LUA, FINISHED_KEY, FINISHED_TAGS_KEY, RELEASED_FIELD
from grpo_stream.common.rollouts.fencing import FENCE_LUA
from grpo_stream.common.rollouts.redis_errors import COUNT_LUA

# damaged_type(key, kind): an error naming `key` when it holds another type than `kind` (absent is fine);
# damaged_integer(key, field): one naming the field (field nil: the string at `key`) when it holds no integer HINCRBY
# takes (redis_errors.py: COUNT_LUA; checked before the first write, the write must not fail after it).
DAMAGED_INTEGER_LUA = COUNT_LUA + """
local function damaged_type(key, kind)
  local found = redis.call('TYPE', key)['ok']
  if found == 'none' or found == kind then return nil end
  return redis.error_reply('DAMAGEDBUFFER ' .. key .. ' is a ' .. found .. ', not the ' .. kind .. ' the rollout '
    .. 'buffer keeps there (something other than grpo-stream wrote it); nothing was written. Restore the key')
end
local function damaged_integer(key, field)
  local kind = field and 'hash' or 'string'
  local bad = damaged_type(key, kind)
  if bad then return bad end
  local raw
  if field then raw = redis.call('HGET', key, field) else raw = redis.call('GET', key) end
  if raw == false or is_count(raw) then return nil end
  local where, fix = key, 'SET ' .. key .. ' N'
  if field then where, fix = key .. ' field ' .. field, 'HSET ' .. key .. ' ' .. field .. ' N' end
  return redis.error_reply('DAMAGEDBUFFER ' .. where .. ' holds ' .. string.format('%q', string.sub(raw, 1, 40))
    .. ', not an integer; nothing was written. Restore it (' .. fix .. ')')
end
"""

# damaged_prompt(base, pid): what an injected answer's append writes besides the buffer (its prompt's hash, the
# queue's sets and counts, the kept results: finish_prompt), checked as the buffer's own keys are, before any write.
# KEYS[7], KEYS[8]: audit:eval, audit:compacted (APPEND's keys).
DAMAGED_PROMPT_LUA = """
local function damaged_prompt(base, pid)
  local pkey = base .. ':prompt:' .. pid
  local bad = damaged_type(pkey, 'hash') or damaged_type(KEYS[7], 'hash')
    or damaged_type(base .. ':inject:claimed', 'zset') or damaged_type(base .. ':inject:queue', 'zset')
    or damaged_type(base .. ':""" + FINISHED_KEY + """', 'zset')
    or damaged_type(base .. ':""" + FINISHED_TAGS_KEY + """', 'hash')
    or damaged_type(base .. ':results', 'stream') or damaged_integer(KEYS[8], '""" + RELEASED_FIELD + """')
  if bad then return bad end
  local client = redis.call('HGET', pkey, 'client')
  if client then return damaged_integer(base .. ':inject:pending', client) end
  return nil
end
"""

# One call appends a batch in order. Room is counted in groups not yet trained: those the trainer trained but
# holds unacknowledged until a checkpoint are not a backlog. A group id already accepted is answered `dup` and
# not written again: a sampler that resends after a lost acknowledgement creates no second copy; nor is one at or
# below its sampler's compacted data position (its accepted record was folded into counts), unless compaction
# passed over that position without a group there (compaction_holes.py).
# KEYS[9]/ARGV[9]: the fence key and the writer's fence ('' for a standalone ingest); the groups from ARGV[10] on.
APPEND = FINISH_PROMPT_LUA + FENCE_LUA + HOLES_LUA + DAMAGED_INTEGER_LUA + DAMAGED_PROMPT_LUA + """
redis.replicate_commands()
local refused = stale(KEYS[9], ARGV[9])
if refused then return refused end
-- checked before the first write: Redis does not roll a script back, so an error after it leaves half a batch (a
-- counter that is no integer failed its HINCRBY after the XADD: a group in the stream that no counter knows; so
-- did a damaged key of an injected prompt answered later in the batch)
local damaged = damaged_integer(KEYS[6], nil) or damaged_type(KEYS[1], 'stream') or damaged_type(KEYS[4], 'hash')
for _, name in ipairs({'ingested', 'refused_invalid', 'refused_duplicate', 'refused_full'}) do
  damaged = damaged or damaged_integer(KEYS[2], name)
end
for i = 10, #ARGV, 6 do
  damaged = damaged or damaged_below(KEYS[8], ARGV[i + 1]) or damaged_integer(KEYS[3], ARGV[i + 1])
    or damaged_integer(KEYS[5], ARGV[i + 1])
  if ARGV[i + 5] ~= '' then damaged = damaged or damaged_prompt(ARGV[5], ARGV[i + 5]) end
end
if damaged then return damaged end
local waiting = redis.call('XLEN', KEYS[1]) - tonumber(redis.call('GET', KEYS[6]) or '0')
local room = tonumber(ARGV[2]) - waiting
if tonumber(ARGV[4]) > 0 then redis.call('HINCRBY', KEYS[2], 'refused_invalid', ARGV[4]) end
local out, full, dups, fulls, added, per_sampler, top = {}, false, 0, 0, 0, {}, {}
local base, retention, keep, gid_prefix = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
for i = 10, #ARGV, 6 do
  local gid, sampler, position, pid = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 3]), ARGV[i + 5]
  local pkey, state, train, client = nil, nil, true, nil
  if pid ~= '' then  -- an injected prompt's answer: its prompt decides whether it is trained on
    pkey = base .. ':prompt:' .. pid
    state = redis.call('HGET', pkey, 'state')
    train = redis.call('HGET', pkey, 'train') == '1'
    client = redis.call('HGET', pkey, 'client')  -- read before the writes: a hash without one must not fail after
  end
  local past = compacted_position(KEYS[8], sampler, position)  -- at or below the compacted watermark?
  if pid ~= '' and not state then
    out[#out + 1] = 'unknown'
  elseif state == 'cancelled' then
    out[#out + 1] = 'cancelled'
  elseif state == 'done' or redis.call('HEXISTS', KEYS[4], gid) == 1 or past == 'dup' then
    dups = dups + 1
    out[#out + 1] = 'dup'
  elseif train and (full or room <= 0) then
    full = true
    fulls = fulls + 1
    out[#out + 1] = 'full'
  else
    local id = 'eval'
    if train then
      id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[i + 4], 'id', gid)
      redis.call('HSET', KEYS[4], gid, cjson.encode({entry = id, sampler = sampler, version = tonumber(ARGV[i + 2]),
                                                    position = position, t = tonumber(ARGV[3]), prompt = pid}))
      per_sampler[sampler] = (per_sampler[sampler] or 0) + 1
      if past == 'hole' then fill_hole(KEYS[8], sampler, position) end  -- a position compaction passed over
      if position >= 0 and position > (top[sampler] or -1) then top[sampler] = position end
      added, room, waiting = added + 1, room - 1, waiting + 1
    else
      redis.call('HSET', KEYS[7], gid, cjson.encode({prompt = pid, sampler = sampler, version = tonumber(ARGV[i + 2]),
                                                    t = tonumber(ARGV[3])}))
    end
    if pkey then
      redis.call('HSET', pkey, 'state', 'done', 'result', ARGV[i + 4], 'version', ARGV[i + 2], 'sampler', sampler,
                 'group', gid, 'finished', ARGV[3])
      redis.call('ZREM', base .. ':inject:claimed', pid)
      redis.call('ZREM', base .. ':inject:queue', pid)  -- a late answer to a claim that was queued again
      if client then redis.call('HINCRBY', base .. ':inject:pending', client, -1) end
      finish_prompt(base, gid_prefix, pid, tonumber(ARGV[3]), retention, keep)
    end
    out[#out + 1] = id
  end
end
-- counters once per call, not per group
if dups > 0 then redis.call('HINCRBY', KEYS[2], 'refused_duplicate', dups) end
if fulls > 0 then redis.call('HINCRBY', KEYS[2], 'refused_full', fulls) end
if added > 0 then redis.call('HINCRBY', KEYS[2], 'ingested', added) end
for sampler, n in pairs(per_sampler) do redis.call('HINCRBY', KEYS[3], sampler, n) end
for sampler, position in pairs(top) do
  if position > tonumber(redis.call('HGET', KEYS[5], sampler) or '-1') then
    redis.call('HSET', KEYS[5], sampler, position)
  end
end
table.insert(out, 1, tostring(waiting))
return out
"""

# Records are (entry id, group id, outcome, step). Only entries still in the stream count, so settling twice is
# harmless. A duplicate never overwrites the record of the copy that was settled first.
# ARGV: consumer group, time, the writer's fence (KEYS[5] its key), then the records.
SETTLE = FENCE_LUA + DAMAGED_INTEGER_LUA + """
local refused = stale(KEYS[5], ARGV[3])
if refused then return refused end
-- checked before the first write, as in APPEND: a counter that was no integer failed its HINCRBY after the XDELs,
-- and the groups left the stream counted nowhere (a retry finds them gone and counts nothing either)
local damaged, outcomes = damaged_type(KEYS[1], 'stream') or damaged_type(KEYS[3], 'hash'), {}
for i = 4, #ARGV, 4 do
  outcomes[ARGV[i + 2]] = true
  if ARGV[i + 2] == 'dropped_duplicate' then damaged = damaged or damaged_integer(KEYS[4], ARGV[i + 1]) end
end
for outcome in pairs(outcomes) do damaged = damaged or damaged_integer(KEYS[2], outcome) end
if damaged then return damaged end
local n, entries, counts = 0, {}, {}
for i = 4, #ARGV, 4 do
  entries[#entries + 1] = ARGV[i]
  if #entries == 500 or i + 4 > #ARGV then  -- acknowledged in chunks: unpack has a stack limit
    redis.call('XACK', KEYS[1], ARGV[1], unpack(entries))
    entries = {}
  end
end
for i = 4, #ARGV, 4 do
  local entry, gid, outcome = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if redis.call('XDEL', KEYS[1], entry) == 1 then
    counts[outcome] = (counts[outcome] or 0) + 1
    if outcome == 'dropped_duplicate' then
      redis.call('HINCRBY', KEYS[4], gid, 1)
    else
      redis.call('HSET', KEYS[3], gid, cjson.encode({outcome = outcome, step = tonumber(ARGV[i + 3]), entry = entry,
                                                    t = tonumber(ARGV[2])}))
    end
    n = n + 1
  end
end
for outcome, c in pairs(counts) do redis.call('HINCRBY', KEYS[2], outcome, c) end
return n
"""


# The positions of one sampler in [ARGV[3], ARGV[2]) with no accepted group (RedisStreamBuffer.unanswered_positions):
# above the compacted watermark, no accepted record under its group id (ARGV[4] .. position); at or below it, a hole.
# KEYS: audit:accepted, audit:compacted. Read-only; a damaged watermark is named (damaged_below).
UNANSWERED = HOLES_LUA + """
local sampler, below, low, prefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local damaged = damaged_below(KEYS[2], sampler)
if damaged then return damaged end
local out = {}
for position = low, below - 1 do
  local past = compacted_position(KEYS[2], sampler, position)
  if past == 'hole' or (past == nil and redis.call('HEXISTS', KEYS[1], prefix .. position) == 0) then
    out[#out + 1] = position
  end
end
return out
"""
