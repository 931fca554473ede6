"""What a run and its followers write while it goes: token events (EMIT), its lease
(RENEW, RECLAIM, HANDOVER), a follower (FOLLOW), a cancel (CANCEL)."""

from __future__ import annotations

from gateway.server.queue.scripts.shared import _CLOCK, _NOTICES, NOTICES_KEPT

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
