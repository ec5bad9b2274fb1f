"""How long a finished injected prompt stays in Redis: `prompts.result_retention_s`, or until
`prompts.max_kept_results` newer prompts have finished, whichever comes first.

A time bound alone lets a busy run fill Redis: the soak benchmark's 32 clients finished ~800 prompts a minute at
~2.3 KB each (the answer group rides in the prompt's hash), so a week's retention never ends within a run. The
count bound keeps Redis memory flat under any injection rate. Both scripts that finish a prompt (the rollout
buffer's append, on an answer; the prompt queue's cancel) call `finish_prompt` from FINISH_PROMPT_LUA, in the same
atomic step, so the bound holds whichever way prompts finish.

Layout (run R, prefix P):
  P:R:inject:finished  sorted set: finished prompt id -> time it finished; the oldest go first
  P:R:inject:finished-tags  hash: finished prompt id -> its tags, so that its id leaves its tags' sets even when
                       its hash expired first (a tag in use kept every id ever tagged); each tag's set lives at least
                       the retention after its newest prompt finished
What leaves with a prompt: its hash, its id in its tags' sets, its entry in the results stream (trimmed to the
same count), and, for a train=false answer, its record in P:R:audit:eval (counted in P:R:audit:compacted as
`evaluation_only_released`, so `grpo-stream audit` still reports how many there were).
"""

FINISHED_KEY = "inject:finished"
FINISHED_TAGS_KEY = "inject:finished-tags"  # hash: finished prompt id -> its tags (JSON), until it is evicted
RELEASED_FIELD = "evaluation_only_released"
EVICT_PER_CALL = 100  # a lowered bound (a restart with a smaller max) drains over several calls, never one long one

FINISH_PROMPT_LUA = """
-- a prompt's tags as Submit writes them (a JSON list of strings); anything else (a hand edit, a foreign tool) is no
-- tags, never a script error: the script runs after the append's or the cancel's first writes, which Redis keeps
local function tag_list(raw)
  if not raw then return {} end
  local ok, decoded = pcall(cjson.decode, raw)
  if not ok or type(decoded) ~= 'table' then return {} end
  local out = {}
  for _, tag in ipairs(decoded) do
    if type(tag) == 'string' then out[#out + 1] = tag end
  end
  return out
end

local function finish_prompt(base, gid_prefix, pid, now, retention, keep)
  redis.call('EXPIRE', base .. ':prompt:' .. pid, retention)
  -- its tags outlive its hash (which may expire before it is evicted here) and its result stays findable by tag
  -- for the whole retention
  local own = tag_list(redis.call('HGET', base .. ':prompt:' .. pid, 'tags'))
  if #own > 0 then
    redis.call('HSET', base .. ':%(tags)s', pid, cjson.encode(own))
    for _, tag in ipairs(own) do
      local tkey = base .. ':tag:' .. tag
      -- again: the set expires result_retention_s after its last submit, and a prompt that waited longer in the
      -- queue would finish into no set, never found by its tag
      -- (a key of another type, which something else wrote, is left alone: no script error after the first writes)
      local kind = redis.call('TYPE', tkey)['ok']
      if kind == 'set' or kind == 'none' then redis.call('SADD', tkey, pid) end
      if redis.call('TTL', tkey) < retention then redis.call('EXPIRE', tkey, retention) end
    end
  end
  redis.call('XADD', base .. ':results', 'MAXLEN', '~', keep, '*', 'id', pid)
  local finished = base .. ':%(finished)s'
  -- ranked in finishing order, whatever the finishing process's clock says: scored below the prompts before it (an
  -- ingest whose clock is behind), it was the oldest, and the count bound evicted it in this very call
  local newest = redis.call('ZREVRANGE', finished, 0, 0, 'WITHSCORES')[2]
  redis.call('ZADD', finished, math.max(now, tonumber(newest or now) or now), pid)
  local over = math.min(redis.call('ZCARD', finished) - keep, %(per_call)d)
  local old = {}
  if over > 0 then  -- one more than needed: this prompt, on a tie, is never among them
    for _, p in ipairs(redis.call('ZRANGE', finished, 0, over)) do
      if p ~= pid and #old < over then old[#old + 1] = p end
    end
  end
  for _, p in ipairs(redis.call('ZRANGEBYSCORE', finished, '-inf', now - retention, 'LIMIT', 0, %(per_call)d)) do
    if p ~= pid then old[#old + 1] = p end
  end
  local released = 0
  for _, p in ipairs(old) do
    local pkey = base .. ':prompt:' .. p
    -- kept apart: the hash may be gone already
    for _, tag in ipairs(tag_list(redis.call('HGET', base .. ':%(tags)s', p))) do
      redis.call('SREM', base .. ':tag:' .. tag, p)
    end
    redis.call('HDEL', base .. ':%(tags)s', p)
    redis.call('DEL', pkey)
    released = released + redis.call('HDEL', base .. ':audit:eval', gid_prefix .. p)
    redis.call('ZREM', finished, p)
  end
  if released > 0 then redis.call('HINCRBY', base .. ':audit:compacted', '%(released)s', released) end
end
""" % {"finished": FINISHED_KEY, "per_call": EVICT_PER_CALL, "released": RELEASED_FIELD, "tags": FINISHED_TAGS_KEY}


def group_id_prefix(run_name: str) -> str:
    """An injected prompt's answer has group id `<run>/inj/<prompt id>` (the sampler names it so)."""
    return f"{run_name}/inj/"
