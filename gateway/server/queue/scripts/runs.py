"""What a run and its followers write while it goes: token events (EMIT), its lease
(RENEW, RECLAIM, HANDOVER), a follower (FOLLOW), a cancel (CANCEL)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.protocol.redis_keys import Shard
from gateway.server.queue.job import TokenEvent
from gateway.server.queue.scripts.keys import handover_keys, lease_keys, reclaim_keys, request_keys, script_json
from gateway.server.queue.scripts.shared import _CLOCK, _NOTICES, NOTICES_KEPT


@dataclass(frozen=True, slots=True)
class Emit:
    """An EMIT call: token events of runs of one shard."""

    shard: Shard
    events: tuple[TokenEvent, ...]

    def keys(self) -> list[str]:
        return [self.shard.notices, *(key for e in self.events for key in request_keys(self.shard, e.request_id))]

    def args(self) -> list[str]:
        events = [
            {"run": e.run, "index": e.index, "count": e.count, "text": e.text, "ids": "".join(f"{t}," for t in e.ids)}
            for e in self.events
        ]
        return [script_json({"events": events})]


@dataclass(frozen=True, slots=True)
class Renew:
    """A RENEW call: the leases of (request id, run token) runs of one shard end lease_ms
    from now, by Redis's clock."""

    shard: Shard
    consumer: str
    lease_ms: int
    runs: tuple[tuple[str, str], ...]

    def keys(self) -> list[str]:
        return lease_keys(self.shard, [request_id for request_id, _ in self.runs])

    def args(self) -> list[str]:
        ids, runs = [request_id for request_id, _ in self.runs], [run for _, run in self.runs]
        return [script_json({"consumer": self.consumer, "lease_ms": self.lease_ms, "ids": ids, "runs": runs})]


def renew_call(shard: Shard, consumer: str, lease_ms: int, runs: list[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """RENEW's keys and arguments (Renew), for a caller with a script of its own (the lease
    keeper's thread: spine.keep_leases)."""
    call = Renew(shard, consumer, lease_ms, tuple(runs))
    return call.keys(), call.args()


@dataclass(frozen=True, slots=True)
class Reclaim:
    """A RECLAIM call: up to `limit` runs of a shard whose lease ran out."""

    shard: Shard
    limit: int = 200

    def keys(self) -> list[str]:
        return reclaim_keys(self.shard)

    def args(self) -> list[str]:
        return [script_json({"prefix": self.shard.prefix, "limit": self.limit})]


@dataclass(frozen=True, slots=True)
class Handover:
    """A HANDOVER call: a consumer's (request id, run token) runs of one shard, handed on."""

    shard: Shard
    consumer: str
    runs: tuple[tuple[str, str], ...]

    def keys(self) -> list[str]:
        return handover_keys(self.shard, [request_id for request_id, _ in self.runs])

    def args(self) -> list[str]:
        ids, runs = [request_id for request_id, _ in self.runs], [run for _, run in self.runs]
        return [script_json({"prefix": self.shard.prefix, "consumer": self.consumer, "ids": ids, "runs": runs})]


@dataclass(frozen=True, slots=True)
class Follow:
    """A FOLLOW call: the request's events are followed (notice: named in the notices now)."""

    shard: Shard
    request_id: str
    notice: bool = False

    def keys(self) -> list[str]:
        return [self.shard.request(self.request_id), self.shard.notices]

    def args(self) -> list[str]:
        return [script_json({"id": self.request_id, "notice": self.notice})]


@dataclass(frozen=True, slots=True)
class Cancel:
    """A CANCEL call: the request is asked to stop (its runner told on `channel`)."""

    shard: Shard
    request_id: str
    channel: str

    def keys(self) -> list[str]:
        return [self.shard.request(self.request_id)]

    def args(self) -> list[str]:
        return [script_json({"id": self.request_id, "channel": self.channel})]


# KEYS: the shard's notices, then per token event its request's hash, events and token
#   ids (request_keys).
# ARGV: one JSON object (Emit.args): events, per token event {run (its token), index (of
#   its first piece), count (pieces), text, ids (token ids, '1,2,3,' or '')}
# Token events of several runs of a shard in one call (TokenRelay sends what every stream
# of the process produced in a window). Returns per event {outcome, event id, pieces
# emitted}: outcome 'ok', 'cancel' (published, but the request is asked to stop), 'stale'
# (another run took over), 'gap' (the stream holds fewer pieces than index: send again
# from there). A replay of pieces already in the stream changes nothing ('ok', '').
EMIT = (
    _NOTICES
    + """
local out = {}
for e, a in ipairs(cjson.decode(ARGV[1]).events) do
  local req, events, tokens = KEYS[e * 3 - 1], KEYS[e * 3], KEYS[e * 3 + 1]
  local run, index, text, count, ids = a.run, a.index, a.text, a.count, a.ids
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
# ARGV: one JSON object (Renew.args): consumer, lease_ms (the lease length, from Redis's
#   clock now), ids (the runs' requests) and runs (their tokens), side by side: two lists
#   of strings decode without a table a run (RENEW runs every few seconds for every run).
# Renews the leases of the runs still ours; returns per run: 1 still ours, 2 ours but
# asked to cancel, 0 stale (another run took over, or it was handed on), 3 ended while
# still this run's (FINISH keeps `run` and `owner`): its own FINISH landed before this
# renewal, whose list of runs was taken while that FINISH was in flight, or the sweeper
# expired it (its run's own deadline cuts it too).
RENEW = (
    _CLOCK
    + """
local a = cjson.decode(ARGV[1])
local out = {}
local ends = lease_end(a.lease_ms)
for i, id in ipairs(a.ids) do
  local h = redis.call('HMGET', KEYS[i + 1], 'state', 'run', 'cancel', 'owner')
  if h[2] ~= a.runs[i] or h[4] ~= a.consumer then
    out[#out + 1] = 0
  elseif h[1] ~= 'running' then
    out[#out + 1] = 3
  else
    redis.call('ZADD', KEYS[1], ends, id)
    out[#out + 1] = h[3] == '1' and 2 or 1
  end
end
return out
"""
)

# KEYS: the shard's leases, deadlines and backlog (reclaim_keys).  ARGV: one JSON object
#   (Reclaim.args): prefix, limit.
# Running requests whose lease ran out (their dispatcher died or stalled) go to the front
# of the line (`reclaimed:<model>`), to be started again by any dispatcher, and into the
# deadlines set if a start at once kept them out of it (the sweeper expires them there
# if no dispatcher starts them in time). Which requests they are is found here: their
# keys are built from the prefix.
RECLAIM = (
    _CLOCK
    + """
local a = cjson.decode(ARGV[1])
local P = a.prefix
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', lease_end(0), 'LIMIT', 0, a.limit)
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
# ARGV: one JSON object (Handover.args): prefix, consumer, ids (the runs' requests) and runs
#   (their tokens), side by side (as RENEW's).
# A stopping dispatcher hands its running requests on: each goes to the front of the line
# at once (no lease to wait out), if it is still running and still this run's, and into
# the deadlines set if it was kept out of it (as RECLAIM). A hand-over is counted
# (`handovers`): it is no failed delivery, the delivery limit leaves it out.
# (The reclaimed list is the request's model's, read from its hash: built here.)
HANDOVER = """
local a = cjson.decode(ARGV[1])
local P = a.prefix
local moved = 0
local woken = {}
for i, id in ipairs(a.ids) do
  local req = KEYS[i + 3]
  local h = redis.call('HMGET', req, 'state', 'model', 'owner', 'run', 'deadline', 'in_deadlines')
  if h[1] == 'running' and h[3] == a.consumer and h[4] == a.runs[i] then
    redis.call('HDEL', req, 'owner', 'in_deadlines')
    if h[6] == '0' then redis.call('ZADD', KEYS[2], h[5], id) end
    redis.call('HINCRBY', req, 'handovers', 1)
    redis.call('ZREM', KEYS[1], id)
    redis.call('RPUSH', P .. 'reclaimed:' .. h[2], id)
    redis.call('HINCRBY', KEYS[3], 'r:' .. h[2], 1)
    woken[h[2]] = true
    moved = moved + 1
  end
end
for model in pairs(woken) do redis.call('PUBLISH', 'work', P .. model) end
return moved
"""


# KEYS[1]: the request hash, KEYS[2]: the shard's notices.  ARGV: one JSON object
#   (Follow.args): id, notice (name it in the notices at once).
# A process's event hub follows the request's events: the scripts that write them name it
# in the shard's notices from now on (_NOTICES). A new follower has it named at once too:
# the hub's reader, blocked on the notices, wakes and reads the stream from the start,
# without being interrupted (results/events.py). Never re-creates a hash that has expired.
FOLLOW = f"""
if redis.call('HEXISTS', KEYS[1], 'state') == 0 then return 0 end
redis.call('HSET', KEYS[1], 'followed', '1')
local a = cjson.decode(ARGV[1])
if a.notice then redis.call('XADD', KEYS[2], 'MAXLEN', '~', {NOTICES_KEPT}, '*', 'ids', a.id) end
return 1
"""

# KEYS[1]: the request hash.  ARGV: one JSON object (Cancel.args): id, channel (cancel's).
# Never re-creates a hash that has expired.
CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if state ~= 'queued' and state ~= 'running' then return state end
redis.call('HSET', KEYS[1], 'cancel', '1')
if state == 'running' then
  local a = cjson.decode(ARGV[1])
  redis.call('PUBLISH', a.channel, a.id)
end
return state
"""
