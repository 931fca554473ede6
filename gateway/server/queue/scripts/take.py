"""TAKE: the next requests of a model in the fair order, started for a dispatcher."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.protocol.redis_keys import Shard
from gateway.server.queue.scripts.keys import model_keys, number_text, script_json, shard_keys
from gateway.server.queue.scripts.shared import _MODEL, _SHARD


@dataclass(frozen=True, slots=True)
class Take:
    """A TAKE call: start up to `most` requests of a model in a shard for a consumer."""

    shard: Shard
    model: str
    consumer: str
    now: float
    lease_ms: int  # its runs' lease length (they end by Redis's clock)
    token: str  # random: the first run's token too (its fence); the n-th run's is the token and '.n'
    token_ttl_s: int  # how long the call is remembered (a replay after a lost reply)
    most: int = 1  # the caller's free slots
    light_only: bool = False  # only a tenant that runs nothing of the model now (the light tenants' headroom)

    def keys(self) -> list[str]:
        return [*shard_keys(self.shard), *model_keys(self.shard, self.model), self.shard.take(self.consumer)]

    def args(self) -> list[str]:
        fields = {
            "prefix": self.shard.prefix,
            "model": self.model,
            "consumer": self.consumer,
            "now": number_text(self.now),
            "lease_ms": self.lease_ms,
            "token": self.token,
            "token_ttl": self.token_ttl_s,
            "most": max(1, self.most),
            "light": self.light_only,
        }
        return [script_json(fields)]


# KEYS: shard_keys, model_keys (15), then the consumer's last take (take:<consumer>).
# ARGV: one JSON object (Take.args): prefix, model, consumer, now, lease_ms (its runs'
#   lease length, ending by Redis's clock), token (random: the first started run's token
#   too, its fence; the n-th run's is the token and '.n'), token_ttl (s), most (how many
#   to start at most: the caller's free slots), light (only a tenant that runs nothing of
#   this model now: the headroom kept for light tenants)
# Returns {'run', then per run started: id, request hash, token ids}, or {'empty'} or
# {'held'} (work waits, but only for tenants that are not light: the headroom is kept). Each
# run is the fair order's next, as if taken by a call of its own: the counters a start
# changes are read again for the next. The requests it starts, and the picked tenants'
# queues and blocked sets, are found as it runs: their keys are built here.
TAKE = (
    _SHARD
    + _MODEL
    + """
local a = cjson.decode(ARGV[1])
local P = a.prefix  -- the shard's prefix: only for the keys a script finds as it runs
local model, consumer, now, token = a.model, a.consumer, a.now, a.token
local most = math.max(1, a.most)
local TAKEN = KEYS[16]
local run_lease_end = lease_end(a.lease_ms)
local function answer(out, rid, emitted)
  local req = P .. 'req:' .. rid
  out[#out + 1] = rid
  out[#out + 1] = redis.call('HGETALL', req)
  -- Token ids are kept only for pieces emitted (EMIT): none emitted, none to read.
  out[#out + 1] = num(emitted) > 0 and (redis.call('GET', P .. 'tokens:' .. rid) or '') or ''
end
-- The last call's token, then the id and run token of each run it started.
local last = redis.call('GET', TAKEN)
if last and string.match(last, '^(%S+)') == token then  -- this very call, replayed after a lost reply
  local out = {'run'}
  for rid, run in string.gmatch(string.sub(last, #token + 2), '(%S+) (%S+)') do
    local req = P .. 'req:' .. rid
    local h = redis.call('HMGET', req, 'state', 'owner', 'run', 'emitted')
    if h[1] == 'running' and h[2] == consumer and h[3] == run then answer(out, rid, h[4]) end
  end
  return #out > 1 and out or {'empty'}
end
local taken = {token}
local function start(rid, restarted, run)
  local req = P .. 'req:' .. rid
  local h = redis.call('HMGET', req, 'tenant', 'band', 'size', 'emitted', 'attempts', 'followed')
  if not restarted then
    local total_field, tenant_field = counters(h[2], h[1])
    decr(BACKLOG, total_field, 1)
    decr(BACKLOG, tenant_field, 1)
    decr(BACKLOG, 'bytes', num(h[3]))
    decr(BACKLOG, 'B:' .. h[1], num(h[3]))
    decr(BACKLOG, 'm:' .. model, 1)
    redis.call('HINCRBY', RUNNING, 't:' .. h[1], 1)
    redis.call('HINCRBY', RUNNING, 'm:' .. model .. ':' .. h[1], 1)
    -- Starts from the queue only (SUBMIT's starts at once never waited): the rate a
    -- queued request's place moves at.
    redis.call('HINCRBY', STARTED, model, 1)
  end
  local attempt = num(h[5]) + 1
  redis.call('HSET', req, 'state', 'running', 'attempts', attempt, 'started_at', now, 'owner', consumer, 'run', run)
  redis.call('ZADD', LEASES, run_lease_end, rid)
  redis.call('XADD', P .. 'events:' .. rid, '*', 'event', 'running', 'data',
    cjson.encode({attempt = attempt, restarted = restarted, resume_from = num(h[4])}))
  notice(h[6], rid)
  taken[#taken + 1] = rid .. ' ' .. run
  return h[4]  -- pieces emitted by earlier runs
end
local light = a.light
-- The first tenant of a band's ready set TAKE may serve (a tenant at its concurrency limit
-- leaves the set for its blocked set; light only: a tenant that runs nothing of the model):
-- tenant, its score, the set's least score; or nil and whether tenants wait that are not light.
local function head_of(band)
  local mb = model .. ':' .. band
  local ready = READY[band]
  for i = 1, 64 do
    local heads = redis.call('ZRANGE', ready, 0, light and 7 or 0, 'WITHSCORES')
    if #heads == 0 then return nil, nil, nil, false end
    local removed = false
    for j = 1, #heads, 2 do
      local t = heads[j]
      if at_limit(t) then
        redis.call('ZREM', ready, t)
        redis.call('SADD', P .. 'blocked:' .. t, mb)
        removed = true
      elseif not light or num(redis.call('HGET', RUNNING, 'm:' .. model .. ':' .. t)) == 0 then
        return t, tonumber(heads[j + 1]), tonumber(heads[2]), false
      end
    end
    if not removed then return nil, nil, nil, light end
  end
  return nil, nil, nil, false
end
-- The tenant's next request of the band, if still queued; its score moves on by 1/weight,
-- in the other shared band too (a tenant waiting in both has one share, not two), and the
-- band's clock to the set's least score.
local function pop(band, tenant, score, least)
  local mb = model .. ':' .. band
  local ready = READY[band]
  local q = P .. 'q:' .. mb .. ':' .. tenant
  local rid = redis.call('LPOP', q)
  local step = 1 / conf(tenant)
  if redis.call('LLEN', q) == 0 then
    redis.call('ZREM', ready, tenant)
  else
    redis.call('ZADD', ready, score + step, tenant)
  end
  local other = band == 'high' and READY.normal or band == 'normal' and READY.high or nil
  if other then redis.call('ZADD', other, 'XX', 'INCR', step, tenant) end
  if least > vnow(mb) then redis.call('HSET', VCLOCK, clock(mb), least) end
  if rid and redis.call('HGET', P .. 'req:' .. rid, 'state') == 'queued' then return rid end
  return nil
end
-- The next request to start: (id, restarted), or nil and whether work is held back.
local function next_request()
  -- Requests whose dispatcher died (or handed them over) first: they were running.
  for i = 1, 32 do
    local rid = redis.call('LPOP', RECLAIMED)
    if not rid then break end
    decr(BACKLOG, 'r:' .. model, 1)
    local h = redis.call('HMGET', P .. 'req:' .. rid, 'state', 'owner')
    if h[1] == 'running' and not h[2] then return rid, true end
  end
  -- The high and normal bands by score across both (the high band's lead is in its
  -- scores; a tie goes to the high band), then the low band, then the batch band.
  for i = 1, 64 do
    local best, held = nil, false
    for _, band in ipairs({'high', 'normal'}) do
      local tenant, score, least, h = head_of(band)
      held = held or h
      if tenant and (not best or score < best[3]) then best = {band, tenant, score, least} end
    end
    if not best then
      if held then return nil, true end
      break
    end
    local rid = pop(unpack(best))
    if rid then return rid, false end
  end
  for _, band in ipairs({'low', 'batch'}) do
    for i = 1, 64 do
      local tenant, score, least, held = head_of(band)
      if not tenant then
        if held then return nil, true end
        break
      end
      local rid = pop(band, tenant, score, least)
      if rid then return rid, false end
    end
  end
  return nil, false
end
local out, held = {'run'}, false
for n = 1, most do
  local rid, restarted = next_request()
  if not rid then held = restarted break end
  answer(out, rid, start(rid, restarted, n == 1 and token or token .. '.' .. n))
end
if #out > 1 then
  redis.call('SET', TAKEN, table.concat(taken, ' '), 'EX', a.token_ttl)
  write_notices(NOTICES)
  return out
end
return {held and 'held' or 'empty'}
"""
)
