"""The Lua scripts behind every change of a request's state.

Each script runs over one shard (gateway.protocol.redis_keys), and every key it knows
before it runs arrives in KEYS, in the order the functions below (shard_keys, model_keys,
tenant_keys, request_keys, ...) list them: Redis Cluster routes the call by them and,
while a slot migrates, redirects or retries it on them. The keys a script can only find
as it runs (the request TAKE starts and the queue of the tenant it picks, the requests
RECLAIM finds due, the ready sets a tenant's run unblocks, a queued request's queue) are
built inside from ARGV[1], the shard's prefix; all of a shard's keys carry its hash tag,
so they live in its slot (docs/deployment.md: moving a slot safely).

Each script is atomic and idempotent: replayed after a lost reply (the client retries on
connection errors) it changes nothing more. A replay of SUBMIT or FINISH that finds its
own earlier write still makes a write (`sync`, a key of the shard that lives a second):
the WAIT that follows it on the new connection then covers the write it found (WAIT
counts only the writes of its own connection; a connection that wrote nothing would be
confirmed at once, whatever the replicas hold).

Runs are fenced by a random run token: TAKE (or SUBMIT, starting at once) writes the
run's token into the request's hash (`run`), and EMIT, RENEW, HANDOVER and FINISH refuse
any other, so a dispatcher that lost its request to another can neither publish, nor
keep, hand on or finish it. The attempt number (`attempts`, one more at each start) is
for display, resuming and the delivery limit only: after a failover that lost a TAKE it
is handed out again, a token never is. A hand-over (a draining gateway passing its run
on) is counted apart (`handovers`): the delivery limit counts attempts less hand-overs.

The queue: a request waits in its tenant's list `q:<model>:<band>:<tenant>`; tenants with
waiting work are members of `ready:<model>:<band>`, scored by virtual time (start-time
fair queuing: a tenant's score grows by 1/weight with each request it starts; a tenant
that becomes ready joins at the current virtual time). The high and normal bands share
one virtual clock (`clock`) and are served by score across both: a tenant joining the
high band (a grant: api/admin.py) joins HIGH_BAND_LEAD ahead of the clock, so its
requests go first while it is within its share, and a flood of them gets the tenant its
share and no more (each start moves its score in both bands). The low band is served
when neither holds a tenant to serve, the batch band after all. One decision costs
O(log tenants)."""

from __future__ import annotations

from typing import Any

from gateway.protocol.redis_keys import BANDS, Shard

# A tenant joining the high band joins this far ahead of the virtual clock: its first
# requests go before the normal band's by up to this many starts at weight 1.
HIGH_BAND_LEAD = 4

# -- The keys, in the order the scripts read them from KEYS ------------------------------


def shard_keys(shard: Shard) -> list[str]:
    """KEYS[1..10] of SUBMIT, TAKE and FINISH: the shard's own keys (see _SHARD)."""
    return [
        shard.tenants,
        shard.running,
        shard.vclock,
        shard.backlog,
        shard.started,
        shard.leases,
        shard.deadlines,
        shard.results,
        shard.sync,
        shard.notices,
    ]


def model_keys(shard: Shard, model: str) -> list[str]:
    """KEYS[11..15] of TAKE (see _MODEL), and the first of a submission's keys in SUBMIT
    and of a request's in FINISH: the model's reclaimed list and its ready set in each band."""
    return [shard.reclaimed(model), *(shard.ready(model, band) for band in BANDS)]


def tenant_keys(shard: Shard, model: str, tenant: str) -> list[str]:
    """After model_keys in a submission's keys in SUBMIT and a request's in FINISH: the
    tenant's blocked set and its queue of the model in each band."""
    return [shard.blocked(tenant), *(shard.queue(model, band, tenant) for band in BANDS)]


def request_keys(shard: Shard, request_id: str) -> list[str]:
    """A request's hash, events and token ids (in this order)."""
    return [shard.request(request_id), shard.events(request_id), shard.tokens(request_id)]


def lease_keys(shard: Shard, request_ids: list[str]) -> list[str]:
    """KEYS of RENEW: the shard's leases, then each run's request hash."""
    return [shard.leases, *(shard.request(request_id) for request_id in request_ids)]


def reclaim_keys(shard: Shard) -> list[str]:
    """KEYS of RECLAIM: the shard's leases, deadlines and backlog counters."""
    return [shard.leases, shard.deadlines, shard.backlog]


def handover_keys(shard: Shard, request_ids: list[str]) -> list[str]:
    """KEYS of HANDOVER: those of RECLAIM, then each run's request hash."""
    return [*reclaim_keys(shard), *(shard.request(request_id) for request_id in request_ids)]


def renew_call(shard: Shard, consumer: str, lease_ms: int, runs: list[tuple[str, str]]) -> tuple[list[str], list[Any]]:
    """RENEW's keys and arguments: the leases of (request id, run token) runs end lease_ms
    from now, by Redis's clock."""
    args: list[Any] = [consumer, lease_ms]
    for request_id, run in runs:
        args += [request_id, run]
    return lease_keys(shard, [request_id for request_id, _ in runs]), args


# Lease ends are Redis's clock plus a lease's length, and RECLAIM compares them with Redis's
# clock: one host's clock, whichever gateway writes or reclaims (clocks of two hosts drift).
_CLOCK = """
local function lease_end(ms)
  local t = redis.call('TIME')
  return tostring(tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ms))
end
"""

# The requests of a call whose events some process's hub follows (their hash has
# `followed`): named once, after them, in one entry of the shard's notices stream, which a
# hub following too many streams to name them all reads instead (results/events.py). The
# stream keeps about the last NOTICES_KEPT entries: a notice a hub misses only delays
# events, since it reads all its streams every few seconds anyway.
NOTICES_KEPT = 1000
_NOTICES = f"""
local noticed = {{}}
local function notice(followed, id) if followed == '1' then noticed[#noticed + 1] = id end end
local function write_notices(key)
  if #noticed > 0 then
    redis.call('XADD', key, 'MAXLEN', '~', {NOTICES_KEPT}, '*', 'ids', table.concat(noticed, ' '))
  end
end
"""

# The shard's keys and the helpers over them: counters that vanish at zero, tenant
# settings, the concurrency limit, the virtual clock, `sync`.
_SHARD = (
    f"""
local HIGH_BAND_LEAD = {HIGH_BAND_LEAD}
"""
    + """
local P = ARGV[1]  -- the shard's prefix: only for the keys a script finds as it runs
local TENANTS, RUNNING, VCLOCK, BACKLOG, STARTED, LEASES, DEADLINES, RESULTS, SYNC, NOTICES = unpack(KEYS, 1, 10)
local function num(v) return tonumber(v) or 0 end
local function decr(key, field, by)
  if by ~= 0 and redis.call('HINCRBY', key, field, -by) <= 0 then redis.call('HDEL', key, field) end
end
local function conf(tenant)
  local c = redis.call('HGET', TENANTS, tenant)
  if not c then return 1, 0 end
  local w, l = string.match(c, '^(%S+) (%S+)$')
  return num(w) > 0 and num(w) or 1, num(l)
end
local function at_limit(tenant)
  local _, limit = conf(tenant)
  return limit > 0 and num(redis.call('HGET', RUNNING, 't:' .. tenant)) >= limit
end
-- The virtual clock a band's tenants are scored by: the high and normal bands share the
-- normal band's (served by score across both), low and batch have their own.
local function clock(mb)
  local model, band = string.match(mb, '^(.*):([^:]*)$')
  if band == 'high' then return model .. ':normal' end
  return mb
end
local function vnow(mb) return num(redis.call('HGET', VCLOCK, clock(mb))) end
-- The score a tenant that becomes ready in (model, band) joins at: the clock, less the
-- high band's lead.
local function joins_at(mb)
  local v = vnow(mb)
  if string.sub(mb, -5) == ':high' then return v - HIGH_BAND_LEAD end
  return v
end
local function counters(band, tenant)
  if band == 'batch' then return 'batch', 'b:' .. tenant end
  return 'all', 't:' .. tenant
end
-- A replay that found its own earlier write writes this (it changes nothing), so that
-- the WAIT after the script on this connection covers the write it found. Once a call.
local synced = false
local function sync()
  if not synced then redis.call('SET', SYNC, '1', 'PX', 1000) synced = true end
end
-- Changes of the running counters a call for many items writes once, after them (in the
-- order first seen); running() reads a counter with its pending change.
local pending, pending_order = {}, {}
local function pend(field, by)
  if not pending[field] then pending[field] = 0 pending_order[#pending_order + 1] = field end
  pending[field] = pending[field] + by
end
local function running(field) return num(redis.call('HGET', RUNNING, field)) + (pending[field] or 0) end
local function write_pending()
  for _, field in ipairs(pending_order) do
    local by = pending[field]
    if by > 0 then redis.call('HINCRBY', RUNNING, field, by) else decr(RUNNING, field, -by) end
  end
end
"""
    + _NOTICES
    + _CLOCK
)

# The model's keys (model_keys).
_MODEL = """
local RECLAIMED = KEYS[11]
local READY = {high = KEYS[12], normal = KEYS[13], low = KEYS[14], batch = KEYS[15]}
"""

# KEYS: shard_keys (10), then per submission its model_keys and tenant_keys (10) and per
#   request its hash, its events and, when it has an idempotency key, that key (the
#   request's ARGV says whether).
# ARGV: prefix, then per submission its head, one JSON object (JobStore.submit: model,
#   tenant, band, now, idem_ttl, admission (Admission.script_arg), consumer to start it at
#   once ('' = queue it), lease_ms (the length of that run's lease), running (the running
#   event's data), light ('1': start at once only if the tenant runs nothing of this
#   model), k (requests), run (the token of the run started at once)), then per request 6:
#   id, payload, created_at, deadline, idempotency key suffix ('' = none), idempotency value
# Returns per submission {'accepted'}, {'started'}, {'existing', value per request} or
# {'full', reason, count}. The K requests of a submission are admitted together or not at
# all.
#
# Admission (`over` below) is one rule applied to the requests and to their bytes, side by
# side: the tenant's own cap always binds; its share binds only while other tenants wait
# (work-conserving); the shard's cap binds unless the tenant is below its reserve. Bytes are
# the payloads as stored (UTF-8 JSON), counted once.
#
# Starting at once (K = 1, the caller's process has a free slot for the model): one round
# trip from accepted to running. Only where TAKE would pick it next anyway: nothing
# reclaimed waits, no higher band has a ready tenant, the tenant has nothing waiting in
# its own queue (so it would join the band at the current virtual time, ahead of every
# waiting tenant), it is below its concurrency limit, and (light only) it runs nothing of
# this model.
#
# Several submissions of a shard go in one call when they are ready together (the group
# commit merges them: SUBMIT_HEAD), each admitted as if alone, in turn. What they share is
# written once, after them: the running counters of the runs started at once (read in
# between with what is pending added) and their leases; a tenant's settings are checked
# once.
SUBMIT = (
    _SHARD
    + """
local leases = {}  -- score, id, ... of the runs started at once
local settings_seen = {}  -- tenant -> its settings, as written
-- The backlog's counters, each read once a call and kept as the call writes them: the
-- submissions of one call mostly share them.
local backlog = {}
local function backlog_of(fields)
  local missing = {}
  for _, f in ipairs(fields) do if backlog[f] == nil then missing[#missing + 1] = f end end
  if #missing > 0 then
    local got = redis.call('HMGET', BACKLOG, unpack(missing))
    for i, f in ipairs(missing) do backlog[f] = num(got[i]) end
  end
  local values = {}
  for i, f in ipairs(fields) do values[i] = backlog[f] end
  return unpack(values)
end
local function add_backlog(f, by) backlog[f] = redis.call('HINCRBY', BACKLOG, f, by) end
-- One submission: its keys after KEYS[kb], its arguments after ARGV[ab]. Returns its
-- answer and how many keys and arguments it took.
-- Over a cap? One dimension of admission (requests or bytes): the tenant's own cap
-- (0: none) always binds, its share (0: none) while other tenants wait, the shard's cap
-- unless the tenant is below its reserve. 'tenant', 'full' or nil.
local function over(total, mine, add, cap, own, share, reserve)
  if own > 0 and mine + add > own then return 'tenant' end
  if share > 0 and mine + add > share and total > mine then return 'tenant' end
  if total + add > cap and mine + add > reserve then return 'full' end
  return nil
end
-- One submission: its keys after KEYS[kb], its arguments after ARGV[ab]. Returns its
-- answer and how many keys and arguments it took.
local function submit(kb, ab)
  local a = cjson.decode(ARGV[ab + 1])
  local adm = a.admission
  local READY = {high = KEYS[kb + 2], normal = KEYS[kb + 3], low = KEYS[kb + 4], batch = KEYS[kb + 5]}
  local BLOCKED = KEYS[kb + 6]
  local QUEUE = {high = KEYS[kb + 7], normal = KEYS[kb + 8], low = KEYS[kb + 9], batch = KEYS[kb + 10]}
  local model, tenant, band, now, consumer = a.model, a.tenant, a.band, a.now, a.consumer
  local k, run = a.k, a.run
  local function field(i, n) return ARGV[ab + 1 + (i - 1) * 6 + n] end
  local REQ, EVENTS, IDEM = {}, {}, {}
  local at = kb + 11
  for i = 1, k do
    REQ[i], EVENTS[i] = KEYS[at], KEYS[at + 1]
    at = at + 2
    if field(i, 5) ~= '' then IDEM[i] = KEYS[at] at = at + 1 end
  end
  local used_keys, used_args = at - kb - 1, 1 + 6 * k
  local h = redis.call('HMGET', REQ[1], 'state', 'run')
  if h[1] then  -- this very call, replayed after a lost reply
    sync()
    if k == 1 and consumer ~= '' and h[1] == 'running' and h[2] == run then return {'started'}, used_keys, used_args end
    return {'accepted'}, used_keys, used_args
  end
  local existing = {'existing'}
  for i = 1, k do
    if IDEM[i] then
      local previous = redis.call('GET', IDEM[i])
      if previous then existing[#existing + 1] = previous end
    end
  end
  if #existing > 1 then
    sync()  -- the answer is the earlier submission: the WAIT covers it
    return existing, used_keys, used_args
  end
  local total_field, tenant_field = counters(band, tenant)
  local bytes_field = 'B:' .. tenant
  local total, mine, bytes, my_bytes, waiting, reclaimed =
    backlog_of({total_field, tenant_field, 'bytes', bytes_field, 'm:' .. model, 'r:' .. model})
  local size = 0
  for i = 1, k do size = size + string.len(field(i, 2)) end
  local cap = band == 'batch' and adm.max_batch_backlog or adm.max_backlog
  local by_count = over(total, mine, k, cap, adm.tenant_max_queued, adm.tenant_share, adm.reserve)
  if by_count then
    local reason = by_count == 'tenant' and 'tenant' or (band == 'batch' and 'batch' or 'backlog')
    return {'full', reason, tostring(by_count == 'tenant' and mine or total)}, used_keys, used_args
  end
  local by_bytes = over(bytes, my_bytes, size, adm.max_bytes, 0, adm.tenant_bytes_share, adm.bytes_reserve)
  if by_bytes then
    local reason = by_bytes == 'tenant' and 'tenant_bytes' or 'bytes'
    return {'full', reason, tostring(by_bytes == 'tenant' and my_bytes or bytes)}, used_keys, used_args
  end
  -- The tenant's settings (TAKE reads them for the tenants it picks), written when they
  -- changed; this submission's own are its arguments.
  local settings = adm.settings
  if settings_seen[tenant] ~= settings then
    if redis.call('HGET', TENANTS, tenant) ~= settings then redis.call('HSET', TENANTS, tenant, settings) end
    settings_seen[tenant] = settings
  end
  local limit = adm.max_concurrent
  local function own_limit_reached()
    return limit > 0 and running('t:' .. tenant) >= limit
  end
  local q = QUEUE[band]
  local function first_in_line()
    if reclaimed > 0 then return false end  -- the counter of the reclaimed list (`r:<model>`)
    -- Nothing of the model waits in the shard (its backlog counter): no queue of it holds a
    -- request, so no ready set of it holds a tenant TAKE would serve first.
    if waiting == 0 then return true end
    if redis.call('LLEN', q) > 0 then return false end
    for _, higher in ipairs({'high', 'normal', 'low', 'batch'}) do
      if higher == band then return true end
      if redis.call('ZCARD', READY[higher]) > 0 then return false end
    end
    return true
  end
  local light_ok = a.light ~= '1' or running('m:' .. model .. ':' .. tenant) == 0
  local start_now = k == 1 and consumer ~= '' and light_ok and not own_limit_reached() and first_in_line()
  local state = {'state', 'queued', 'attempts', 0}
  -- A run started at once stays out of the deadlines set: its own run cuts it at its
  -- deadline, and if its process goes, RECLAIM or HANDOVER puts it in (`in_deadlines`).
  if start_now then
    state = {'state', 'running', 'attempts', 1, 'started_at', now, 'owner', consumer, 'run', run, 'in_deadlines', '0'}
  end
  for i = 1, k do
    local id, payload = field(i, 1), field(i, 2)
    redis.call('HSET', REQ[i], 'model', model, 'tenant', tenant, 'band', band, 'payload', payload,
      'size', string.len(payload), 'created_at', field(i, 3), 'deadline', field(i, 4), 'emitted', 0, unpack(state))
    local queued = cjson.encode({request_id = id, model = model, created_at = tonumber(field(i, 3))})
    if IDEM[i] then redis.call('SET', IDEM[i], field(i, 6), 'EX', a.idem_ttl) end
    if start_now then
      pend('t:' .. tenant, 1)
      pend('m:' .. model .. ':' .. tenant, 1)
      leases[#leases + 1] = lease_end(a.lease_ms)
      leases[#leases + 1] = id
      -- Its `queued` and `running` events in one entry (results/events.py reads it as both).
      redis.call('XADD', EVENTS[i], '*', 'event', 'running', 'data', a.running, 'queued', queued)
      return {'started'}, used_keys, used_args
    end
    redis.call('XADD', EVENTS[i], '*', 'event', 'queued', 'data', queued)
    redis.call('ZADD', DEADLINES, field(i, 4), id)
    redis.call('RPUSH', q, id)
  end
  -- The tenant has waiting work in (model, band): it joins the ready set at the current
  -- virtual time, unless it is at its concurrency limit (then it waits in its blocked set).
  local mb = model .. ':' .. band
  if not redis.call('ZSCORE', READY[band], tenant) then
    if own_limit_reached() then
      redis.call('SADD', BLOCKED, mb)
    else
      redis.call('ZADD', READY[band], joins_at(mb), tenant)
    end
  end
  add_backlog(total_field, k)
  add_backlog(tenant_field, k)
  add_backlog('bytes', size)
  add_backlog(bytes_field, size)
  add_backlog('m:' .. model, k)
  if waiting == 0 then redis.call('PUBLISH', 'work', P .. model) end
  return {'accepted'}, used_keys, used_args
end
local out = {}
local kb, ab = 10, 1
while kb < #KEYS do
  local answer, used_keys, used_args = submit(kb, ab)
  out[#out + 1] = answer
  kb, ab = kb + used_keys, ab + used_args
end
write_pending()
if #leases > 0 then redis.call('ZADD', LEASES, unpack(leases)) end
return out
"""
)

# The keys and arguments SUBMIT's submissions share: a call for several submissions of a
# shard is these once, then each submission's own (submit_keys and its arguments).
SUBMIT_HEAD = (10, 1)
# At most this many submissions in one SUBMIT.
SUBMIT_MOST = 64

# KEYS: shard_keys, model_keys (15), then the consumer's last take (take:<consumer>).
# ARGV: prefix, model, consumer, now, lease length (ms; ends by Redis's clock), take token (random: the first started
#   run's token too, its fence; the n-th run's is the token and '.n'), light only ('1': only
#   a tenant that runs nothing of this model now, the headroom kept for light tenants),
#   token ttl (s), how many to start at most (the caller's free slots)
# Returns {'run', then per run started: id, request hash, token ids}, or {'empty'} or
# {'held'} (work waits, but only for tenants that are not light: the headroom is kept). Each
# run is the fair order's next, as if taken by a call of its own: the counters a start
# changes are read again for the next. The requests it starts, and the picked tenants'
# queues and blocked sets, are found as it runs: their keys are built here.
TAKE = (
    _SHARD
    + _MODEL
    + """
local model, consumer, now, token = ARGV[2], ARGV[3], ARGV[4], ARGV[6]
local most = math.max(1, tonumber(ARGV[9]) or 1)
local TAKEN = KEYS[16]
local run_lease_end = lease_end(ARGV[5])
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
local light = ARGV[7] == '1'
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
  redis.call('SET', TAKEN, table.concat(taken, ' '), 'EX', ARGV[8])
  write_notices(NOTICES)
  return out
end
return {held and 'held' or 'empty'}
"""
)

# KEYS: the shard's notices, then per token event its request's hash, events and token
#   ids (request_keys).
# ARGV: per token event: run token, index of the first piece, text, piece count, token ids
#   ('1,2,3,' or '')
# Token events of several runs of a shard in one call (TokenRelay sends what every stream
# of the process produced in a window). Returns per event {outcome, event id, pieces
# emitted}: outcome 'ok', 'cancel' (published, but the request is asked to stop), 'stale'
# (another run took over), 'gap' (the stream holds fewer pieces than index: send again
# from there). A replay of pieces already in the stream changes nothing ('ok', '').
EMIT = (
    _NOTICES
    + """
local out = {}
for e = 0, #ARGV / 5 - 1 do
  local req, events, tokens = KEYS[e * 3 + 2], KEYS[e * 3 + 3], KEYS[e * 3 + 4]
  local a = e * 5
  local run, index, text, count, ids = ARGV[a + 1], tonumber(ARGV[a + 2]), ARGV[a + 3], tonumber(ARGV[a + 4]),
    ARGV[a + 5]
  local h = redis.call('HMGET', req, 'state', 'run', 'emitted', 'cancel', 'followed')
  local emitted = tonumber(h[3] or '0')
  local outcome = h[4] == '1' and 'cancel' or 'ok'
  local event = ''
  if h[1] ~= 'running' or h[2] ~= run then
    outcome, emitted = 'stale', 0
  elseif index + count <= emitted then
    -- a replay: already there
  elseif index ~= emitted then
    outcome = 'gap'
  else
    event = redis.call('XADD', events, '*', 'event', 'token', 'data',
      cjson.encode({index = index, count = count, text_output = text}), 'i', index, 'n', count)
    emitted = index + count
    redis.call('HSET', req, 'emitted', emitted)
    if ids ~= '' then redis.call('APPEND', tokens, ids) end
    notice(h[5], string.match(req, 'req:(.*)$'))
  end
  out[#out + 1] = outcome
  out[#out + 1] = event
  out[#out + 1] = emitted
end
write_notices(KEYS[1])
return out
"""
)

# KEYS: the shard's leases, then per run its request's hash (lease_keys).
# ARGV: consumer, lease length (ms, from Redis's clock now), then pairs of request id and its run's token.
# Renews the leases of the runs still ours; returns per run: 1 still ours, 2 ours but
# asked to cancel, 0 stale (another run took over, or it was handed on), 3 ended while
# still this run's (FINISH keeps `run` and `owner`): its own FINISH landed before this
# renewal, whose list of runs was taken while that FINISH was in flight, or the sweeper
# expired it (its run's own deadline cuts it too).
RENEW = (
    _CLOCK
    + """
local out = {}
local ends = lease_end(ARGV[2])
for i = 3, #ARGV, 2 do
  local h = redis.call('HMGET', KEYS[(i - 1) / 2 + 1], 'state', 'run', 'cancel', 'owner')
  if h[2] ~= ARGV[i + 1] or h[4] ~= ARGV[1] then
    out[#out + 1] = 0
  elseif h[1] ~= 'running' then
    out[#out + 1] = 3
  else
    redis.call('ZADD', KEYS[1], ends, ARGV[i])
    out[#out + 1] = h[3] == '1' and 2 or 1
  end
end
return out
"""
)

# KEYS: the shard's leases, deadlines and backlog (reclaim_keys).  ARGV: prefix, limit
# Running requests whose lease ran out (their dispatcher died or stalled) go to the front
# of the line (`reclaimed:<model>`), to be started again by any dispatcher, and into the
# deadlines set if a start at once kept them out of it (the sweeper expires them there
# if no dispatcher starts them in time). Which requests they are is found here: their
# keys are built from the prefix.
RECLAIM = (
    _CLOCK
    + """
local P = ARGV[1]
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', lease_end(0), 'LIMIT', 0, tonumber(ARGV[2]))
local woken = {}
for _, rid in ipairs(due) do
  redis.call('ZREM', KEYS[1], rid)
  local req = P .. 'req:' .. rid
  local h = redis.call('HMGET', req, 'state', 'model', 'deadline', 'in_deadlines')
  if h[1] == 'running' then
    redis.call('HDEL', req, 'owner', 'in_deadlines')
    if h[4] == '0' then redis.call('ZADD', KEYS[2], h[3], rid) end
    redis.call('RPUSH', P .. 'reclaimed:' .. h[2], rid)
    redis.call('HINCRBY', KEYS[3], 'r:' .. h[2], 1)
    woken[h[2]] = true
  end
end
for model in pairs(woken) do redis.call('PUBLISH', 'work', P .. model) end
return #due
"""
)

# KEYS: those of RECLAIM, then per run its request's hash (handover_keys).
# ARGV: prefix, consumer, then pairs of request id and its run's token.
# A stopping dispatcher hands its running requests on: each goes to the front of the line
# at once (no lease to wait out), if it is still running and still this run's, and into
# the deadlines set if it was kept out of it (as RECLAIM). A hand-over is counted
# (`handovers`): it is no failed delivery, the delivery limit leaves it out.
# (The reclaimed list is the request's model's, read from its hash: built here.)
HANDOVER = """
local P = ARGV[1]
local moved = 0
local woken = {}
for i = 3, #ARGV, 2 do
  local req = KEYS[(i - 1) / 2 + 3]
  local h = redis.call('HMGET', req, 'state', 'model', 'owner', 'run', 'deadline', 'in_deadlines')
  if h[1] == 'running' and h[3] == ARGV[2] and h[4] == ARGV[i + 1] then
    redis.call('HDEL', req, 'owner', 'in_deadlines')
    if h[6] == '0' then redis.call('ZADD', KEYS[2], h[5], ARGV[i]) end
    redis.call('HINCRBY', req, 'handovers', 1)
    redis.call('ZREM', KEYS[1], ARGV[i])
    redis.call('RPUSH', P .. 'reclaimed:' .. h[2], ARGV[i])
    redis.call('HINCRBY', KEYS[3], 'r:' .. h[2], 1)
    woken[h[2]] = true
    moved = moved + 1
  end
end
for model in pairs(woken) do redis.call('PUBLISH', 'work', P .. model) end
return moved
"""

# KEYS: shard_keys (10), then per request (finish_keys) its model_keys and tenant_keys (10)
#   and its hash, events and token ids (request_keys): 13 a request.
# ARGV: prefix, done channel, then per request (finish_args, 11 each): id, status,
#   record, finished_at, terminal event, allowed states (a,b), '1' for an `output` event
#   (the whole outputs, when they were not streamed), run token ('' = not a run: cancel,
#   expiry), pieces the run emitted ('' = not a streamed run), model, tenant (those its keys
#   were named for)
# Returns per request: {1} when applied, {0} when the request was not in an allowed state
# (or the run is stale), {'gap', emitted} when the stream holds fewer pieces than the run
# sent (Redis lost writes: send them again first), {'error', why} when its keys were named
# for another model or tenant. {0} writes `sync`: it may be this very call, replayed after
# a lost reply, and the WAIT after it must cover the finish it found.
#
# Several requests of a shard end in one call when their FINISHes are ready together (the
# group commit merges them: FINISH_HEAD): what they share is written once at the end — the
# running counters of each tenant and model, the leases, and each tenant's blocked set.
FINISH = (
    _SHARD
    + """
local DONE = ARGV[2]
-- A run of the tenant ended: the ready sets it left at its limit take it back. They may
-- be any model's: their keys are found here, from the blocked set's members.
local function unblock(tenant, blocked)
  if redis.call('EXISTS', blocked) == 0 or at_limit(tenant) then return end
  for _, mb in ipairs(redis.call('SMEMBERS', blocked)) do
    if redis.call('LLEN', P .. 'q:' .. mb .. ':' .. tenant) > 0 then
      redis.call('ZADD', P .. 'ready:' .. mb, 'NX', joins_at(mb), tenant)
      redis.call('PUBLISH', 'work', P .. string.match(mb, '^(.*):[^:]*$'))
    end
  end
  redis.call('DEL', blocked)
end
-- Written once for all the requests of the call, after them (in the order first seen).
local ended_leases = {}
local blocked_of, tenants_order = {}, {}  -- tenant -> its blocked set
-- The requests ended, named in one `done` message (space separated): every gateway process
-- receives it, so it names them rather than carrying records; a waiter it wakes reads the
-- record (results/notifier.py).
local done = {}
local function finish(k, a)
  local RECLAIMED = KEYS[k + 1]
  local READY = {high = KEYS[k + 2], normal = KEYS[k + 3], low = KEYS[k + 4], batch = KEYS[k + 5]}
  local BLOCKED = KEYS[k + 6]
  local QUEUE = {high = KEYS[k + 7], normal = KEYS[k + 8], low = KEYS[k + 9], batch = KEYS[k + 10]}
  local REQ, EVENTS, TOKENS = KEYS[k + 11], KEYS[k + 12], KEYS[k + 13]
  local id, status, record, finished_at, terminal = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  local allowed_states, output, run, sent = ARGV[a + 6], ARGV[a + 7], ARGV[a + 8], ARGV[a + 9]
  local h = redis.call('HMGET', REQ, 'state', 'run', 'model', 'band', 'tenant', 'size', 'owner', 'emitted',
    'in_deadlines', 'followed')
  local state = h[1]
  local allowed = false
  for s in string.gmatch(allowed_states, '[^,]+') do
    if s == state then allowed = true end
  end
  if not allowed or (run ~= '' and h[2] ~= run) then
    sync()
    return {0}
  end
  local model, band, tenant = h[3], h[4], h[5]
  if model ~= ARGV[a + 10] or tenant ~= ARGV[a + 11] then
    return {'error', 'FINISH of ' .. id .. ' named the keys of another model or tenant'}
  end
  if sent ~= '' and num(h[8]) < num(sent) then return {'gap', num(h[8])} end
  if state == 'queued' then
    local total_field, tenant_field = counters(band, tenant)
    decr(BACKLOG, total_field, 1)
    decr(BACKLOG, tenant_field, 1)
    decr(BACKLOG, 'bytes', num(h[6]))
    decr(BACKLOG, 'B:' .. tenant, num(h[6]))
    decr(BACKLOG, 'm:' .. model, 1)
    redis.call('LREM', QUEUE[band], 1, id)
    if redis.call('LLEN', QUEUE[band]) == 0 then redis.call('ZREM', READY[band], tenant) end
  elseif state == 'running' then
    pend('t:' .. tenant, -1)
    pend('m:' .. model .. ':' .. tenant, -1)
    ended_leases[#ended_leases + 1] = id
    if not h[7] and redis.call('LREM', RECLAIMED, 1, id) > 0 then decr(BACKLOG, 'r:' .. model, 1) end
    if not blocked_of[tenant] then blocked_of[tenant] = BLOCKED tenants_order[#tenants_order + 1] = tenant end
  end
  -- The record is written once, to the results stream (for the binders); the output and
  -- terminal events name its entry, and readers take the record from there (or, once it is
  -- stored and trimmed away, from MongoDB).
  local entry = redis.call('XADD', RESULTS, '*', 'id', id, 'record', record)
  -- The payload is emptied in the same write (no longer needed, and it may be large); the
  -- owner stays: only a running request's owner is ever read.
  redis.call('HSET', REQ, 'state', status, 'finished_at', finished_at, 'result', entry, 'payload', '')
  -- The `output` event rides on the terminal event's entry (results/events.py reads both).
  if output ~= '' then
    redis.call('XADD', EVENTS, '*', 'event', terminal, 'record', entry, 'output', '1')
  else
    redis.call('XADD', EVENTS, '*', 'event', terminal, 'record', entry)
  end
  if h[9] ~= '0' then redis.call('ZREM', DEADLINES, id) end  -- a run started at once is not there
  if num(h[8]) > 0 then redis.call('DEL', TOKENS) end  -- token ids are kept only for pieces emitted
  -- No expiry here: the binder gives the hash and the events theirs once it has stored the
  -- record (MARK_STORED), or could not (a dead letter): two commands less a request.
  done[#done + 1] = id
  notice(h[10], id)
  return {1}
end
local out = {}
for r = 0, (#KEYS - 10) / 13 - 1 do
  out[r + 1] = finish(10 + r * 13, 2 + r * 11)
end
write_pending()
write_notices(NOTICES)
if #ended_leases > 0 then redis.call('ZREM', LEASES, unpack(ended_leases)) end
for _, tenant in ipairs(tenants_order) do unblock(tenant, blocked_of[tenant]) end
if #done > 0 then redis.call('PUBLISH', DONE, table.concat(done, ' ')) end
return out
"""
)

# The keys and arguments FINISH's requests share: a call for several requests of a shard is
# these once, then each request's own (finish_keys, finish_args).
FINISH_HEAD = (10, 2)
# At most this many requests in one FINISH (the script runs alone in Redis meanwhile).
FINISH_MOST = 64


def finish_keys(shard: Shard, model: str, tenant: str, request_id: str) -> list[str]:
    """A request's part of FINISH's KEYS (13)."""
    return [*model_keys(shard, model), *tenant_keys(shard, model, tenant), *request_keys(shard, request_id)]


# Where a queued request stands: {its place in its tenant's queue, tenants ready in its
# band, how many of them go before its tenant in this round, tenants ready in higher
# bands plus requests reclaimed (they all go first), requests of its model TAKE started
# from the queue in the shard so far}. The request's model, band and tenant are read from its hash: the queue
# and ready keys are built here.
_STANDING = """
local function standing(P, id, model, band, tenant)
  local mb = model .. ':' .. band
  local ready = P .. 'ready:' .. mb
  local tenants = redis.call('ZCARD', ready)
  local first = redis.call('LLEN', P .. 'reclaimed:' .. model)
  for _, higher in ipairs({'high', 'normal', 'low', 'batch'}) do
    if higher == band then break end
    first = first + redis.call('ZCARD', P .. 'ready:' .. model .. ':' .. higher)
  end
  return {redis.call('LPOS', P .. 'q:' .. mb .. ':' .. tenant, id) or 0, tenants,
    redis.call('ZRANK', ready, tenant) or tenants, first, redis.call('HGET', KEYS[3], model) or '0'}
end
"""

# KEYS: the request's hash, the shard's results stream, the shard's started counters
#   (read_keys).  ARGV: prefix, id.
# Where a queued request stands (see _STANDING); false when it is not queued.
QUEUE = (
    _STANDING
    + """
local h = redis.call('HMGET', KEYS[1], 'state', 'model', 'band', 'tenant')
if h[1] ~= 'queued' then return false end
return standing(ARGV[1], ARGV[2], h[2], h[3], h[4])
"""
)

# KEYS: as QUEUE.  ARGV: prefix, id.
# The request's hash, in one atomic read with what goes with its state: {hash, the record
# (when it has ended and the results stream still holds it) or false, where it stands
# (when it is queued, see _STANDING) or false}. One read: a request read as queued always
# comes with its place, even when a dispatcher takes it a moment later.
READ = (
    _STANDING
    + """
local h = redis.call('HGETALL', KEYS[1])
local f = {}
for i = 1, #h, 2 do f[h[i]] = h[i + 1] end
if f.state == 'queued' then return {h, false, standing(ARGV[1], ARGV[2], f.model, f.band, f.tenant)} end
if f.result then
  local found = redis.call('XRANGE', KEYS[2], f.result, f.result)
  if found[1] then
    local fields = found[1][2]
    for i = 1, #fields, 2 do
      if fields[i] == 'record' then return {h, fields[i + 1], false} end
    end
  end
end
return {h, false, false}
"""
)


def read_keys(shard: Shard, request_id: str) -> list[str]:
    """KEYS of READ and QUEUE."""
    return [shard.request(request_id), shard.results, shard.started]


# KEYS[1]: the request hash, KEYS[2]: the shard's notices.  ARGV: the request's id to name
# in the notices at once ('' = none).
# A process's event hub follows the request's events: the scripts that write them name it
# in the shard's notices from now on (_NOTICES). A new follower has it named at once too:
# the hub's reader, blocked on the notices, wakes and reads the stream from the start,
# without being interrupted (results/events.py). Never re-creates a hash that has expired.
FOLLOW = f"""
if redis.call('HEXISTS', KEYS[1], 'state') == 0 then return 0 end
redis.call('HSET', KEYS[1], 'followed', '1')
if ARGV[1] ~= '' then redis.call('XADD', KEYS[2], 'MAXLEN', '~', {NOTICES_KEPT}, '*', 'ids', ARGV[1]) end
return 1
"""

# KEYS[1]: the request hash.  ARGV: id, cancel channel.
# Never re-creates a hash that has expired.
CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if state ~= 'queued' and state ~= 'running' then return state end
redis.call('HSET', KEYS[1], 'cancel', '1')
if state == 'running' then redis.call('PUBLISH', ARGV[2], ARGV[1]) end
return state
"""
