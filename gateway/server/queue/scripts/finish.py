"""FINISH: a request ends, once, its record in the shard's results stream."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.protocol.redis_keys import Shard
from gateway.server.queue.scripts.keys import finish_keys, head_json, number_text, script_json, shard_keys
from gateway.server.queue.scripts.shared import _SHARD


@dataclass(frozen=True, slots=True)
class FinishItem:
    """One request's end in a FINISH call: its KEYS (finish_keys, 13) and its fields, one
    JSON argument the script reads by name, then its record as it is (Redis stores it and
    never parses it: a record of kilobytes decoded as a JSON string would cost Redis µs
    for nothing)."""

    request_id: str
    model: str  # the model and tenant its keys are named for (the script checks them)
    tenant: str
    status: str  # the state it ends in
    terminal: str  # its terminal event
    record: str  # the record's JSON
    finished_at: float
    allowed: tuple[str, ...] = ("running",)  # the states it may end from
    output_event: bool = False  # an `output` event too: the whole outputs, when they were not streamed
    run: str | None = None  # the run's token (None: not a run: cancel, expiry)
    emitted: int | None = None  # pieces the run emitted (None: not a streamed run)

    def keys(self, shard: Shard) -> list[str]:
        return finish_keys(shard, self.model, self.tenant, self.request_id)

    def args(self) -> list[str]:
        fields = {
            "id": self.request_id,
            "model": self.model,
            "tenant": self.tenant,
            "status": self.status,
            "terminal": self.terminal,
            "finished_at": number_text(self.finished_at),
            "allowed": list(self.allowed),
            "output": self.output_event,
            "run": self.run,
            "emitted": self.emitted,
        }
        return [script_json(fields), self.record]


@dataclass(frozen=True, slots=True)
class Finish:
    """A FINISH call: the requests of one shard that end together (the group commit merges
    the calls ready together: FINISH_HEAD)."""

    shard: Shard
    done_channel: str
    items: tuple[FinishItem, ...]

    def keys(self) -> list[str]:
        keys = shard_keys(self.shard)
        for item in self.items:
            keys += item.keys(self.shard)
        return keys

    def args(self) -> list[str]:
        args = [head_json(self.shard.prefix, self.done_channel)]
        for item in self.items:
            args += item.args()
        return args


# KEYS: shard_keys (10), then per request (FinishItem.keys) its model_keys and tenant_keys
#   (10) and its hash, events and token ids (request_keys): 13 a request.
# ARGV: the call's head, one JSON object (Finish.args: prefix, done channel), then per
#   request 2: its fields, one JSON object (FinishItem: id, model, tenant (those its keys
#   were named for), status, terminal (event), finished_at, allowed (states), output (an
#   `output` event too), run (its token; absent: not a run), emitted (pieces the run sent;
#   absent: not a streamed run)), and its record.
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
local head = cjson.decode(ARGV[1])
local P, DONE = head.prefix, head.done  -- P: the shard's prefix, only for the keys found as it runs
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
local function finish(k, at)
  local a, record = cjson.decode(ARGV[at]), ARGV[at + 1]
  local RECLAIMED = KEYS[k + 1]
  local READY = {high = KEYS[k + 2], normal = KEYS[k + 3], low = KEYS[k + 4], batch = KEYS[k + 5]}
  local BLOCKED = KEYS[k + 6]
  local QUEUE = {high = KEYS[k + 7], normal = KEYS[k + 8], low = KEYS[k + 9], batch = KEYS[k + 10]}
  local REQ, EVENTS, TOKENS = KEYS[k + 11], KEYS[k + 12], KEYS[k + 13]
  local id = a.id
  local h = redis.call('HMGET', REQ, 'state', 'run', 'model', 'band', 'tenant', 'size', 'owner', 'emitted',
    'in_deadlines', 'followed')
  local state = h[1]
  local allowed = false
  for _, s in ipairs(a.allowed) do
    if s == state then allowed = true end
  end
  if not allowed or (a.run and h[2] ~= a.run) then
    sync()
    return {0}
  end
  local model, band, tenant = h[3], h[4], h[5]
  if model ~= a.model or tenant ~= a.tenant then
    return {'error', 'FINISH of ' .. id .. ' named the keys of another model or tenant'}
  end
  if a.emitted and num(h[8]) < a.emitted then return {'gap', num(h[8])} end
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
  redis.call('HSET', REQ, 'state', a.status, 'finished_at', a.finished_at, 'result', entry, 'payload', '')
  -- The `output` event rides on the terminal event's entry (results/events.py reads both).
  if a.output then
    redis.call('XADD', EVENTS, '*', 'event', a.terminal, 'record', entry, 'output', '1')
  else
    redis.call('XADD', EVENTS, '*', 'event', a.terminal, 'record', entry)
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
  out[r + 1] = finish(10 + r * 13, 2 + r * 2)
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
# these once, then each request's own (FinishItem.keys, FinishItem.args).
FINISH_HEAD = (10, 1)
# At most this many requests in one FINISH (the script runs alone in Redis meanwhile).
FINISH_MOST = 64
