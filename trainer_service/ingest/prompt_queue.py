"""The injected-prompt queue in Redis: submit, claim (by samplers), cancel, results, status.

Layout for run R (prefix P, next to the rollout buffer's keys):
  P:R:prompt:<id>        hash: req (InjectedPrompt bytes), spec (PromptSpec bytes), client, state (queued | claimed
                         | done | cancelled), train, score, submitted, tags; once done: result (RolloutGroup bytes),
                         version, sampler, group, finished. Kept prompts.result_retention_s after it finishes, or
                         until prompts.max_kept_results newer ones finished (common/rollouts/kept_results.py).
  P:R:inject:queue       sorted set of queued ids; score = (max_priority - priority) * 2^32 + sequence, so higher
                         priority first and first come first served within a priority
  P:R:inject:q:<client>  the same, one client's queued ids only: the order of that client's own prompts
  P:R:inject:turns       sorted set: client with queued prompts -> the virtual time its next prompt starts at
  P:R:inject:finish      hash: client -> virtual time its last claimed prompt ended at; P:R:inject:vtime: the
                         virtual time now (fair queuing across clients, below)
  P:R:inject:claimed     sorted set of claimed ids by claim time (a claim older than the lease is queued again)
  P:R:inject:pending     hash: client name -> its unfinished prompts (the per-client quota)
  P:R:inject:samplers    hash: sampler id -> time of its last claim (samplers active in the last minute share)
  P:R:inject:credit      hash: sampler id -> injected rows it may still claim (the injected share of its batches)
  P:R:inject:seq         counter
  P:R:tag:<tag>          set of ids carrying the tag (expires the retention after its newest prompt)
  P:R:results            stream: one entry (`id`) per prompt that finished (done or cancelled), for followers
  P:R:audit:eval         hash: group id -> {prompt, sampler, version, t} of every train=false answer (never in the
                         rollout stream; the audit checks no trained step lists one)
  P:R:status             the trainer's status (JSON), rewritten every second

Two shares keep one client from starving training (a client token could otherwise fill every group: injected
prompts start before dataset prompts, sampler_service/group_source.py). Across clients, claims are weighted fair
queuing (start-time fair queuing): the client whose turn starts first is served, and a prompt of priority p moves its
client's next turn on by 1 / (1 + p), so a client flooding at priority 9 takes at most 10 of every 11 prompts claimed
while another client waits at priority 0, never all of them; a client that had nothing queued joins at the current
virtual time (idleness earns no credit). Priority orders a client's own prompts strictly. And per sampler, injected
prompts take at most prompts.max_injected_fraction of the rows of the groups it claims for: each claim adds that
fraction of the rows of the groups admission granted the sampler since its last claim (else all it keeps in flight,
sampler.rows_in_flight) to its credit, capped at the share of all it keeps in flight, and each prompt claimed spends
its rows (a prompt larger than the credit is taken while any is left, and repaid by later claims), so dataset
prompts keep the rest however many prompts wait.

Answers are recorded by the rollout buffer's append script (common/rollouts/buffer.py) in the same atomic step that puts a
train=true group into the rollout stream, so an answer is recorded once and trained at most once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Callable

import redis

from grpo_stream.common.rollouts.kept_results import FINISH_PROMPT_LUA, group_id_prefix
from grpo_stream.common.rollouts.redis_errors import redis_call

log = logging.getLogger(__name__)

ACTIVE_SAMPLER_S = 60.0
SUMMARY_FIELDS = (b"state", b"client", b"finished", b"tags")  # a prompt's hash less its request and answer
NOT_A_HASH = object()  # records(): a prompt key of another type

# Shared by the scripts: a client with queued prompts holds a turn; one that had none joins at the virtual time now
# or where its last prompt ended, whichever is later.
_TURNS = """
local function enter_turns(base, client)
  local turns = base .. ':inject:turns'
  if redis.call('ZSCORE', turns, client) then return end
  local start = math.max(tonumber(redis.call('GET', base .. ':inject:vtime') or '0'),
                         tonumber(redis.call('HGET', base .. ':inject:finish', client) or '0'))
  redis.call('ZADD', turns, start, client)
end
"""

_SUBMIT = _TURNS + """
local base, client, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local max_queued, max_pending, maxp = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local retention = tonumber(ARGV[7])
local n = (#ARGV - 7) / 7
local queued = redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2])
if queued + n > max_queued then return {'full', tostring(queued)} end
local pending = tonumber(redis.call('HGET', KEYS[3], client) or '0')
if pending + n > max_pending then return {'quota', tostring(pending)} end
for i = 8, #ARGV, 7 do
  local pid, priority = ARGV[i], tonumber(ARGV[i + 1])
  local seq = redis.call('INCR', KEYS[4]) % 4294967296
  local score = (maxp - priority) * 4294967296 + seq
  local pkey = base .. ':prompt:' .. pid
  redis.call('HSET', pkey, 'req', ARGV[i + 2], 'spec', ARGV[i + 3], 'client', client, 'state', 'queued',
             'train', ARGV[i + 4], 'score', score, 'submitted', now, 'tags', ARGV[i + 5], 'rows', ARGV[i + 6],
             'priority', priority)
  redis.call('ZADD', KEYS[1], score, pid)
  redis.call('ZADD', base .. ':inject:q:' .. client, score, pid)
  for _, tag in ipairs(cjson.decode(ARGV[i + 5])) do
    redis.call('SADD', base .. ':tag:' .. tag, pid)
    redis.call('EXPIRE', base .. ':tag:' .. tag, retention)  -- a tag outlives its last prompt by the retention
  end
end
enter_turns(base, client)
redis.call('HINCRBY', KEYS[3], client, n)
return {'ok', tostring(queued + n)}
"""

# Expired claims go back to the queue first; then this sampler takes at most its share of the unfinished prompts
# (queued or claimed) among the samplers that claimed in the last minute, less what it holds already, so an
# injection spreads evenly over the samplers; and no more rows than its credit (the injected share of its batches).
# Each prompt comes from the client whose turn starts first (the fair queuing in the module docstring). Prompts
# queued by a version without per-client queues are moved into them first.
_CLAIM = _TURNS + FINISH_PROMPT_LUA + """
local base, sampler, want, now = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local lease, window = tonumber(ARGV[5]), tonumber(ARGV[6])
local grant_rows, burst_rows, default_rows = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local max_claims, retention, keep, gid_prefix = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12]), ARGV[13]
local function requeue(pid, pkey)
  local client = redis.call('HGET', pkey, 'client') or ''
  local score = tonumber(redis.call('HGET', pkey, 'score') or '0')
  redis.call('ZADD', KEYS[1], score, pid)
  redis.call('ZADD', base .. ':inject:q:' .. client, score, pid)
  enter_turns(base, client)
end
if redis.call('ZCARD', KEYS[4]) == 0 and redis.call('ZCARD', KEYS[1]) > 0 then
  for _, pid in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do requeue(pid, base .. ':prompt:' .. pid) end
end
for _, pid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - lease)) do
  redis.call('ZREM', KEYS[2], pid)
  local pkey = base .. ':prompt:' .. pid
  if redis.call('HGET', pkey, 'state') == 'claimed' then
    local lapses = redis.call('HINCRBY', pkey, 'lapses', 1)
    if lapses >= max_claims then  -- given up: no sampler answers it (their logs say why)
      redis.call('HSET', pkey, 'state', 'cancelled', 'finished', now, 'error', 'claimed ' .. lapses ..
                 ' times and never answered within prompts.claim_lease_s (prompts.max_claims): the samplers that ' ..
                 'took it, the last ' .. (redis.call('HGET', pkey, 'sampler') or '?') .. ', dropped it; their ' ..
                 'logs say why (e.g. wider than their groups, or an environment failing every episode)')
      redis.call('HINCRBY', KEYS[6], redis.call('HGET', pkey, 'client') or '', -1)
      finish_prompt(base, gid_prefix, pid, now, retention, keep)
    else
      redis.call('HSET', pkey, 'state', 'queued')
      requeue(pid, pkey)
    end
  end
end
redis.call('HSET', KEYS[3], sampler, now)
local active, seen = 0, redis.call('HGETALL', KEYS[3])
for i = 1, #seen, 2 do
  if now - tonumber(seen[i + 1]) <= window then active = active + 1 else
    redis.call('HDEL', KEYS[3], seen[i])
    -- a quiet sampler's unused credit goes, its debt stays: one that took a prompt wider than its credit (and then
    -- waited a minute for its rows) must repay it before it takes the next one
    if tonumber(redis.call('HGET', KEYS[5], seen[i]) or '0') >= 0 then redis.call('HDEL', KEYS[5], seen[i]) end
  end
end
local credit = math.min(tonumber(redis.call('HGET', KEYS[5], sampler) or '0') + grant_rows, burst_rows)
local queued, held = redis.call('ZCARD', KEYS[1]), 0
local claimed = redis.call('ZRANGE', KEYS[2], 0, -1)
for _, pid in ipairs(claimed) do
  if redis.call('HGET', base .. ':prompt:' .. pid, 'sampler') == sampler then held = held + 1 end
end
-- a share of everything unfinished (queued or claimed), less what this sampler already holds
local take = math.min(want, queued, math.ceil((queued + #claimed) / math.max(active, 1)) - held)
local out, turns = {}, base .. ':inject:turns'
while #out < 2 * take and credit > 0 do  -- out: id, req per prompt
  local head = redis.call('ZRANGE', turns, 0, 0, 'WITHSCORES')
  if #head == 0 then break end
  local client, start = head[1], tonumber(head[2])
  local cq = base .. ':inject:q:' .. client
  local popped = redis.call('ZPOPMIN', cq)
  if #popped == 0 then
    redis.call('ZREM', turns, client)
  else
    local pid = popped[1]
    local pkey = base .. ':prompt:' .. pid
    redis.call('ZREM', KEYS[1], pid)
    if redis.call('HGET', pkey, 'state') == 'queued' then  -- never hand out a finished prompt again
      local finish = start + 1 / (1 + tonumber(redis.call('HGET', pkey, 'priority') or '0'))
      redis.call('SET', base .. ':inject:vtime', start)
      if redis.call('ZCARD', cq) > 0 then
        redis.call('ZADD', turns, finish, client)
      else
        redis.call('ZREM', turns, client)
        redis.call('HSET', base .. ':inject:finish', client, finish)
      end
      redis.call('HSET', pkey, 'state', 'claimed', 'sampler', sampler, 'claimed', now)
      redis.call('ZADD', KEYS[2], now, pid)
      out[#out + 1] = pid  -- the key's id: a damaged req cannot name another prompt
      out[#out + 1] = redis.call('HGET', pkey, 'req') or ''
      credit = credit - tonumber(redis.call('HGET', pkey, 'rows') or default_rows)
    end
  end
end
redis.call('HSET', KEYS[5], sampler, credit)
return out
"""

# All or nothing: an unknown id or someone else's prompt (unless admin) refuses the whole call before any change.
_CANCEL = FINISH_PROMPT_LUA + """
local base, client, admin, now, retention = ARGV[1], ARGV[2], ARGV[3] == '1', tonumber(ARGV[4]), tonumber(ARGV[5])
local keep, gid_prefix = tonumber(ARGV[6]), ARGV[7]
for i = 8, #ARGV do
  local pkey = base .. ':prompt:' .. ARGV[i]
  local kind = redis.call('TYPE', pkey)['ok']
  if kind ~= 'hash' and kind ~= 'none' then return {'foreign', ARGV[i]} end
  local owner = redis.call('HGET', pkey, 'client')
  if not owner then return {'unknown', ARGV[i]} end
  if owner ~= client and not admin then return {'denied', ARGV[i]} end
end
local out = {'ok'}
for i = 8, #ARGV do
  local pid = ARGV[i]
  local pkey = base .. ':prompt:' .. pid
  local state = redis.call('HGET', pkey, 'state')
  if state == 'queued' or state == 'claimed' then
    redis.call('HSET', pkey, 'state', 'cancelled', 'finished', now)
    redis.call('ZREM', KEYS[1], pid)
    redis.call('ZREM', base .. ':inject:q:' .. redis.call('HGET', pkey, 'client'), pid)
    redis.call('ZREM', KEYS[2], pid)
    redis.call('HINCRBY', KEYS[3], redis.call('HGET', pkey, 'client'), -1)
    finish_prompt(base, gid_prefix, pid, now, retention, keep)
    out[#out + 1] = 'cancelled'
  else
    out[#out + 1] = 'finished'
  end
end
return out
"""


@dataclasses.dataclass(frozen=True)
class InjectedShare:
    """The injected share of a sampler's groups: `fraction` (prompts.max_injected_fraction) of the rows of the groups
    it was granted since its last claim, at most `groups_in_flight` groups' worth (sampler.rows_in_flight /
    generation.num_generations: all it holds at once) of `group_rows` (generation.num_generations) rows each."""

    fraction: float
    groups_in_flight: int
    group_rows: int

    def rows(self, batch_groups: int | None) -> tuple[float, float]:
        """(credit one claim adds, the most credit kept) for a claim after `batch_groups` granted groups (None: a
        stream's full capacity)."""
        full = self.fraction * self.groups_in_flight * self.group_rows
        groups = self.groups_in_flight if batch_groups is None else min(batch_groups, self.groups_in_flight)
        return self.fraction * groups * self.group_rows, full


class ForeignKey(Exception):
    """A prompt's key holds another type than a hash: something other than grpo-stream wrote it (args[0]: the id)."""


class QueueFull(Exception):
    """Nothing was queued: the queue or the client's quota has no room."""


class PromptQueue:
    """The Redis side of PromptService and of ClaimPrompts. `clock` (seconds, time.time by default) stamps
    submissions, claims and cancellations; the claim lease is judged against it inside the claim script, so a test
    can move it instead of waiting out a lease."""

    def __init__(self, client: redis.Redis, run_name: str, prefix: str = "grpo-stream",
                 clock: Callable[[], float] = time.time):
        self.client, self.clock, self.run_name = client, clock, run_name
        self.base = k = f"{prefix}:{run_name}"
        self.queue, self.claimed = f"{k}:inject:queue", f"{k}:inject:claimed"
        self.pending, self.samplers, self.seq = f"{k}:inject:pending", f"{k}:inject:samplers", f"{k}:inject:seq"
        self.turns, self.credit = f"{k}:inject:turns", f"{k}:inject:credit"
        self.results, self.status_key, self.rollouts = f"{k}:results", f"{k}:status", f"{k}:rollouts"
        self._submit, self._claim, self._cancel = (client.register_script(lua) for lua in (_SUBMIT, _CLAIM, _CANCEL))

    def _call(self, fn):
        return redis_call(fn)

    def prompt_key(self, prompt_id: str) -> str:
        return f"{self.base}:prompt:{prompt_id}"

    @staticmethod
    def new_id() -> str:
        return f"p-{uuid.uuid4().hex[:16]}"

    def submit(self, client_name: str, items: list[tuple[str, int, bytes, bytes, bool, list[str], int]],
               max_queued: int, max_pending: int, max_priority: int, retention_s: int = 7 * 86_400) -> int:
        """Queue (id, priority, InjectedPrompt bytes, PromptSpec bytes, train, tags, rows) items, all or none; `rows`:
        the completions the prompt asks for (its num_generations). Returns the queue length after; raises QueueFull
        (nothing queued) when the queue or the client's quota has no room."""
        args: list = [self.base, client_name, self.clock(), max_queued, max_pending, max_priority, retention_s]
        for pid, priority, req, spec, train, tags, rows in items:
            args += [pid, priority, req, spec, int(train), json.dumps(tags), rows]
        status, count = (x.decode() for x in self._call(lambda: self._submit(
            keys=[self.queue, self.claimed, self.pending, self.seq], args=args)))
        if status == "full":
            raise QueueFull(f"the injection queue holds {count} prompts (prompts.max_queued={max_queued}); "
                            f"{len(items)} more do not fit")
        if status == "quota":
            raise QueueFull(f"client {client_name!r} has {count} unfinished prompts "
                            f"(prompts.max_pending_per_client={max_pending}); {len(items)} more exceed it")
        return int(count)

    def claim(self, sampler_id: str, want: int, lease_s: float, share: InjectedShare | None = None,
              batch_groups: int | None = None, given_up: tuple[int, int, int] = (3, 7 * 86_400, 10_000)
              ) -> list[tuple[str, bytes]]:
        """(prompt id, InjectedPrompt bytes) of up to `want` prompts for this sampler (its fair share of the queue), taken from the
        clients in fair turns, within the injected share of its rows (`share`; None: no limit) for a batch of
        `batch_groups` groups (None: a full batch). Claims whose lease ran out go back to the queue first, or, at
        their `given_up[0]`-th lapse (prompts.max_claims), are finished as cancelled with an error, kept as results
        are (`given_up[1:]`: retention seconds, most kept)."""
        share = share or InjectedShare(1.0, 1 << 20, 1)
        grant_rows, burst_rows = share.rows(batch_groups)
        max_claims, retention_s, max_kept = given_up
        flat = self._call(lambda: self._claim(
            keys=[self.queue, self.claimed, self.samplers, self.turns, self.credit, self.pending],
            args=[self.base, sampler_id, want, self.clock(), lease_s, ACTIVE_SAMPLER_S, grant_rows, burst_rows,
                  share.group_rows, max_claims, retention_s, max_kept, group_id_prefix(self.run_name)]))
        return [(flat[i].decode(), flat[i + 1]) for i in range(0, len(flat), 2)]

    def cancel(self, client_name: str, admin: bool, prompt_ids: list[str], retention_s: int,
               max_kept: int = 10_000) -> dict[str, str]:
        """id -> 'cancelled' | 'finished'. Raises KeyError(id) for an unknown id, PermissionError(id) for another
        client's prompt (unless admin), ForeignKey(id) for a key of another type; then nothing is cancelled. A
        cancelled prompt is kept as a finished one is (common/rollouts/kept_results.py)."""
        prompt_ids = list(dict.fromkeys(prompt_ids))  # an id given twice is answered once, as what happened to it
        reply = [x.decode() for x in self._call(lambda: self._cancel(
            keys=[self.queue, self.claimed, self.pending, self.results],
            args=[self.base, client_name, int(admin), self.clock(), retention_s, max_kept,
                  group_id_prefix(self.run_name), *prompt_ids]))]
        if reply[0] == "unknown":
            raise KeyError(reply[1])
        if reply[0] == "denied":
            raise PermissionError(reply[1])
        if reply[0] == "foreign":
            raise ForeignKey(reply[1])
        return dict(zip(prompt_ids, reply[1:]))

    def _read(self, prompt_ids: list[str], ask) -> list:
        """One pipelined read (`ask(pipe, key)`) a prompt; a key of another type (not grpo-stream's) is NOT_A_HASH."""
        def run():
            pipe = self.client.pipeline(transaction=False)
            for pid in prompt_ids:
                ask(pipe, self.prompt_key(pid))
            replies = pipe.execute(raise_on_error=False)
            for reply in replies:  # any other failure as the read's own (redis_call: passing or not)
                if isinstance(reply, Exception) and "WRONGTYPE" not in str(reply):
                    raise reply
            return [NOT_A_HASH if isinstance(r, Exception) else r for r in replies]
        return self._call(run)

    def records(self, prompt_ids: list[str]) -> list[dict[bytes, bytes] | None]:
        """Each prompt's hash (None: unknown or expired; NOT_A_HASH: its key holds another type)."""
        return [r if r is NOT_A_HASH else r or None for r in self._read(prompt_ids, lambda p, k: p.hgetall(k))]

    def summaries(self, prompt_ids: list[str]) -> list[dict[bytes, bytes] | None]:
        """Each prompt's SUMMARY_FIELDS (None: unknown or expired; NOT_A_HASH as records()): what a follower checks,
        filters and orders by, without the answer group a finished prompt's hash holds."""
        return [r if r is NOT_A_HASH else {k: v for k, v in zip(SUMMARY_FIELDS, r) if v is not None} or None
                for r in self._read(prompt_ids, lambda p, k: p.hmget(k, SUMMARY_FIELDS))]

    def tagged(self, tag: str) -> list[str]:
        return sorted(x.decode() for x in self._call(lambda: self.client.smembers(f"{self.base}:tag:{tag}")))

    def results_tail(self) -> str:
        """Id of the newest finish notification ('0-0' when none): follow from here."""
        last = self._call(lambda: self.client.xrevrange(self.results, count=1))
        return last[0][0].decode() if last else "0-0"

    def wait_finished(self, after: str, block_ms: int) -> tuple[str, list[str]]:
        """Prompt ids that finished after stream id `after` (waiting up to block_ms), and the new position."""
        reply = self._call(lambda: self.client.xread({self.results: after}, count=500, block=block_ms))
        ids = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                after = entry_id.decode()
                ids.append(fields[b"id"].decode())
        return after, ids

    def trimmed_past(self, position: str) -> bool:
        """Whether the results stream's oldest entry is newer than stream id `position`: entries after it may have been
        trimmed (prompts.max_kept_results) before a follower reading from there read them."""
        oldest = self._call(lambda: self.client.xrange(self.results, count=1))
        key = lambda raw: tuple(int(x) for x in raw.split("-"))  # noqa: E731 - stream ids compare as (ms, seq)
        return bool(oldest) and key(oldest[0][0].decode()) > key(position)

    def counts(self) -> tuple[int, int]:
        """(queued, claimed) injected prompts."""
        pipe = self.client.pipeline(transaction=False)
        queued, claimed = self._call(lambda: pipe.zcard(self.queue).zcard(self.claimed).execute())
        return int(queued), int(claimed)

    def write_status(self, status: dict) -> None:
        self._call(lambda: self.client.set(self.status_key, json.dumps(status)))

    def read_status(self) -> dict:
        """The trainer's status record ({} before its first, or when the key holds something else: logged)."""
        raw = self._call(lambda: self.client.get(self.status_key))
        try:
            status = json.loads(raw) if raw else {}
        except ValueError:
            status = None
        if not isinstance(status, dict):
            log.warning("%s holds no status record (a JSON object); the trainer writes it again at its next step",
                        self.status_key)
            return {}
        return status

    def buffer_depth(self) -> int:
        return int(self._call(lambda: self.client.xlen(self.rollouts)))
