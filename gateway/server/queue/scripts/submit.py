"""SUBMIT: requests admitted (by count and by bytes) and queued, or started at once."""

from __future__ import annotations

import json
from dataclasses import dataclass

from gateway.protocol.redis_keys import Shard
from gateway.server.queue.job import Admission, NewRequest
from gateway.server.queue.scripts.keys import head_json, model_keys, number_text, script_json, shard_keys, tenant_keys
from gateway.server.queue.scripts.shared import _SHARD


@dataclass(frozen=True, slots=True)
class Submission:
    """One submission in a SUBMIT call: requests of one tenant and model, admitted together
    or not at all. Its KEYS, then its fields as one JSON argument the script reads by name,
    then each request's payload as it is stored (Redis counts and stores it, never parses
    it)."""

    model: str
    tenant: str
    band: str
    now: float
    idempotency_ttl_s: int
    admission: Admission
    lease_ms: int  # the lease of a run started at once
    running: str  # the data of that run's `running` event
    requests: tuple[NewRequest, ...]
    consumer: str = ""  # start it at once for this consumer (one request only; '': queue it)
    run: str = ""  # the token of the run started at once
    light_only: bool = False  # start at once only if the tenant runs nothing of this model

    def keys(self, shard: Shard) -> list[str]:
        keys = [*model_keys(shard, self.model), *tenant_keys(shard, self.model, self.tenant)]
        for new in self.requests:
            keys += [shard.request(new.request_id), shard.events(new.request_id)]
            if new.idempotency:
                keys.append(shard.idempotency(self.tenant, new.idempotency[0]))
        return keys

    def args(self) -> list[str | bytes]:
        requests = []
        for new in self.requests:
            request = {
                "id": new.request_id,
                "created_at": number_text(new.created_at),
                "deadline": number_text(new.deadline),
                "meta": new.meta,
            }
            if new.idempotency:  # what the key holds: the submission's id and body hash
                request["idem"] = json.dumps({"id": new.request_id, "hash": new.idempotency[1]})
            requests.append(request)
        fields = {
            "model": self.model,
            "tenant": self.tenant,
            "band": self.band,
            "now": number_text(self.now),
            "idem_ttl": self.idempotency_ttl_s,
            "admission": self.admission.script_arg(),
            "consumer": self.consumer,
            "lease_ms": self.lease_ms,
            "running": self.running,
            "light": self.light_only,
            "run": self.run,
            "requests": requests,
        }
        return [script_json(fields), *(new.stored for new in self.requests)]


@dataclass(frozen=True, slots=True)
class Submit:
    """A SUBMIT call: submissions of one shard (the group commit merges the calls ready
    together: SUBMIT_HEAD)."""

    shard: Shard
    submissions: tuple[Submission, ...]

    def keys(self) -> list[str]:
        keys = shard_keys(self.shard)
        for submission in self.submissions:
            keys += submission.keys(self.shard)
        return keys

    def args(self) -> list[str | bytes]:
        args: list[str | bytes] = [head_json(self.shard.prefix)]
        for submission in self.submissions:
            args += submission.args()
        return args


# KEYS: shard_keys (10), then per submission (Submission.keys) its model_keys and
#   tenant_keys (10) and per request its hash, its events and, when it has an idempotency
#   key, that key (the request's `idem` says whether).
# ARGV: the call's head, one JSON object (Submit.args: prefix), then per submission its
#   fields, one JSON object (Submission.args: model, tenant, band, now, idem_ttl, admission
#   (Admission.script_arg), consumer to start it at once ('' = queue it), lease_ms (the
#   length of that run's lease), running (the running event's data), light (start at once
#   only if the tenant runs nothing of this model), run (the token of the run started at
#   once), requests ({id, created_at, deadline, meta (what a status read answers from its
#   payload: NewRequest.meta), idem (what its idempotency key holds; absent: none)} each)),
#   then its requests' payloads, one an argument.
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
local P = cjson.decode(ARGV[1]).prefix  -- the shard's prefix: only for the keys a script finds as it runs
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
  local requests, run = a.requests, a.run
  local k = #requests
  local function payload(i) return ARGV[ab + 1 + i] end
  local REQ, EVENTS, IDEM = {}, {}, {}
  local at = kb + 11
  for i = 1, k do
    REQ[i], EVENTS[i] = KEYS[at], KEYS[at + 1]
    at = at + 2
    if requests[i].idem then IDEM[i] = KEYS[at] at = at + 1 end
  end
  local used_keys, used_args = at - kb - 1, 1 + k
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
  for i = 1, k do size = size + string.len(payload(i)) end
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
  local light_ok = not a.light or running('m:' .. model .. ':' .. tenant) == 0
  local start_now = k == 1 and consumer ~= '' and light_ok and not own_limit_reached() and first_in_line()
  local state = {'state', 'queued', 'attempts', 0}
  -- A run started at once stays out of the deadlines set: its own run cuts it at its
  -- deadline, and if its process goes, RECLAIM or HANDOVER puts it in (`in_deadlines`).
  if start_now then
    state = {'state', 'running', 'attempts', 1, 'started_at', now, 'owner', consumer, 'run', run, 'in_deadlines', '0'}
  end
  for i = 1, k do
    local r, body = requests[i], payload(i)
    local id = r.id
    redis.call('HSET', REQ[i], 'model', model, 'tenant', tenant, 'band', band, 'payload', body, 'meta', r.meta or '{}',
      'size', string.len(body), 'created_at', r.created_at, 'deadline', r.deadline, 'emitted', 0, unpack(state))
    local queued = cjson.encode({request_id = id, model = model, created_at = tonumber(r.created_at)})
    if IDEM[i] then redis.call('SET', IDEM[i], r.idem, 'EX', a.idem_ttl) end
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
    redis.call('ZADD', DEADLINES, r.deadline, id)
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
# shard is these once, then each submission's own (Submission.keys, Submission.args).
SUBMIT_HEAD = (10, 1)
# At most this many submissions in one SUBMIT.
SUBMIT_MOST = 64
