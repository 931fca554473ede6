"""The Lua scripts behind every change of a request's state. Each is atomic, and each is
idempotent: replayed after a lost reply (redis-py retries on connection errors) it
changes nothing more. Runs are fenced by their attempt number: START hands one out, and
EMIT, CHECK and FINISH refuse a stale one, so a dispatcher that lost its request to
another can neither publish nor finish it."""

# KEYS: req, events, queue stream, deadlines, backlog, idempotency ('' = none), registry, running
# ARGV: id, model, tenant, payload, created_at, deadline, max_backlog, max_backlog_bytes,
#       queued event data, idempotency value, idempotency ttl, now, tenant max queued (0 = no limit), band,
#       dispatch group, consumer to start it at once ('' = queue it), running event data
#
# Starting at once (the caller's process has a free slot for the model): only when no
# request of this model is queued anywhere, so nothing is overtaken. The new entry is
# read by the caller's consumer in the same script (entries of requests that ended while
# queued are acknowledged on the way) and the request begins as attempt 1, as START
# would begin it: one round trip from accepted to running.
SUBMIT = """
local existing = redis.call('HMGET', KEYS[1], 'state', 'entry', 'owner', 'attempts')
if existing[1] then
  if existing[1] == 'running' and existing[3] == ARGV[16] and existing[4] == '1' then
    return {'started', existing[2]}
  end
  return {'accepted', existing[2] or ''}
end
if KEYS[6] ~= '' then
  local previous = redis.call('GET', KEYS[6])
  if previous then return {'existing', previous} end
end
local counts = redis.call('HMGET', KEYS[5], 'all', 'bytes', 't:' .. ARGV[3], 'm:' .. ARGV[2])
local size = string.len(ARGV[4])
if tonumber(counts[1] or '0') >= tonumber(ARGV[7]) then return {'full', 'backlog', counts[1]} end
if tonumber(counts[2] or '0') + size > tonumber(ARGV[8]) then return {'full', 'bytes', counts[2]} end
if tonumber(ARGV[13]) > 0 and tonumber(counts[3] or '0') >= tonumber(ARGV[13]) then
  return {'full', 'tenant', counts[3]}
end
if redis.call('ZADD', KEYS[7], ARGV[12], KEYS[3]) == 1 then
  -- A new queue: its consumer group starts before its first entry.
  pcall(redis.call, 'XGROUP', 'CREATE', KEYS[3], ARGV[15], '0', 'MKSTREAM')
end
local entry = redis.call('XADD', KEYS[3], '*', 'id', ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'queued', 'model', ARGV[2], 'tenant', ARGV[3], 'payload', ARGV[4],
  'size', size, 'created_at', ARGV[5], 'deadline', ARGV[6], 'stream', KEYS[3], 'entry', entry,
  'attempts', 0, 'emitted', 0, 'band', ARGV[14])
redis.call('XADD', KEYS[2], '*', 'event', 'queued', 'data', ARGV[9])
redis.call('ZADD', KEYS[4], ARGV[6], ARGV[1])
if KEYS[6] ~= '' then redis.call('SET', KEYS[6], ARGV[10], 'EX', ARGV[11]) end
if ARGV[16] ~= '' and tonumber(counts[4] or '0') == 0 then
  for i = 1, 16 do
    local read = redis.call('XREADGROUP', 'GROUP', ARGV[15], ARGV[16], 'COUNT', 1, 'STREAMS', KEYS[3], '>')
    if not read then break end
    local got = read[1][2][1][1]
    if got == entry then
      redis.call('HSET', KEYS[1], 'state', 'running', 'attempts', 1, 'started_at', ARGV[12], 'owner', ARGV[16])
      redis.call('HINCRBY', KEYS[8], ARGV[3], 1)
      redis.call('XADD', KEYS[2], '*', 'event', 'running', 'data', ARGV[17])
      return {'started', entry}
    end
    redis.call('XACK', KEYS[3], ARGV[15], got)  -- its request ended while it was queued
  end
end
redis.call('HINCRBY', KEYS[5], 'all', 1)
redis.call('HINCRBY', KEYS[5], 'bytes', size)
redis.call('HINCRBY', KEYS[5], 't:' .. ARGV[3], 1)
redis.call('HINCRBY', KEYS[5], 'm:' .. ARGV[2], 1)
return {'accepted', entry}
"""

# Leaving the backlog (started, or ended while queued).
_UNQUEUE = """
local function unqueue(req, backlog)
  local h = redis.call('HMGET', req, 'tenant', 'model', 'size')
  redis.call('HINCRBY', backlog, 'all', -1)
  redis.call('HINCRBY', backlog, 'bytes', -tonumber(h[3] or '0'))
  redis.call('HINCRBY', backlog, 't:' .. (h[1] or ''), -1)
  redis.call('HINCRBY', backlog, 'm:' .. (h[2] or ''), -1)
end
"""

# KEYS: req, events, backlog, tokens, running.  ARGV: consumer, now, entry id
START = (
    _UNQUEUE
    + """
local h = redis.call('HMGET', KEYS[1], 'state', 'entry', 'emitted', 'attempts')
local state = h[1]
if not state then return {'missing'} end
if h[2] ~= ARGV[3] then return {'other_entry'} end
if state ~= 'queued' and state ~= 'running' then return {'done', state} end
if state == 'queued' then
  unqueue(KEYS[1], KEYS[3])
  redis.call('HINCRBY', KEYS[5], redis.call('HGET', KEYS[1], 'tenant') or '', 1)
end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', 'running', 'started_at', ARGV[2], 'owner', ARGV[1])
redis.call('XADD', KEYS[2], '*', 'event', 'running', 'data',
  cjson.encode({attempt = attempt, restarted = (state == 'running'), resume_from = tonumber(h[3] or '0')}))
return {'run', redis.call('HGETALL', KEYS[1]), redis.call('GET', KEYS[4]) or ''}
"""
)

# KEYS: req, events, tokens.  ARGV: attempt, text, count, token ids ('1,2,3,' or '')
# Returns 'ok', 'cancel' (published, but the request is asked to stop) or 'stale'.
EMIT = """
local h = redis.call('HMGET', KEYS[1], 'state', 'attempts', 'emitted', 'cancel')
if h[1] ~= 'running' or h[2] ~= ARGV[1] then return 'stale' end
local index = tonumber(h[3] or '0')
redis.call('XADD', KEYS[2], '*', 'event', 'token', 'data',
  cjson.encode({index = index, count = tonumber(ARGV[3]), text_output = ARGV[2]}))
redis.call('HSET', KEYS[1], 'emitted', index + tonumber(ARGV[3]))
if ARGV[4] ~= '' then redis.call('APPEND', KEYS[3], ARGV[4]) end
if h[4] == '1' then return 'cancel' end
return 'ok'
"""

# KEYS: req keys.  ARGV: the attempt each run holds, in the same order.
# Returns per run: 1 still ours, 2 ours but asked to cancel, 0 stale (another run took over).
CHECK = """
local out = {}
for i, key in ipairs(KEYS) do
  local h = redis.call('HMGET', key, 'state', 'attempts', 'cancel')
  if h[1] ~= 'running' or h[2] ~= ARGV[i] then out[i] = 0
  elseif h[3] == '1' then out[i] = 2
  else out[i] = 1 end
end
return out
"""

# KEYS: req, events, results, deadlines, backlog, tokens, running
# ARGV: status, record, finished_at, terminal event, ttl, id, allowed states (a,b), group,
#       done channel, output event data ('' = none), attempt ('' = not a run: cancel, expiry)
FINISH = (
    _UNQUEUE
    + """
local h = redis.call('HMGET', KEYS[1], 'state', 'attempts', 'stream', 'entry')
local state = h[1]
if not state then return 0 end
local allowed = false
for s in string.gmatch(ARGV[7], '[^,]+') do
  if s == state then allowed = true end
end
if not allowed then return 0 end
if ARGV[11] ~= '' and h[2] ~= ARGV[11] then return 0 end
if state == 'queued' then unqueue(KEYS[1], KEYS[5]) end
if state == 'running' then
  redis.call('HINCRBY', KEYS[7], redis.call('HGET', KEYS[1], 'tenant') or '', -1)
end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'finished_at', ARGV[3])
redis.call('HDEL', KEYS[1], 'payload', 'owner')
if ARGV[10] ~= '' then redis.call('XADD', KEYS[2], '*', 'event', 'output', 'data', ARGV[10]) end
redis.call('XADD', KEYS[2], '*', 'event', ARGV[4], 'data', ARGV[2])
redis.call('XADD', KEYS[3], '*', 'id', ARGV[6], 'record', ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[6])
if h[3] and h[4] then redis.call('XACK', h[3], ARGV[8], h[4]) end
redis.call('DEL', KEYS[6])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
-- The message carries the record, so a waiting client needs no further read.
redis.call('PUBLISH', ARGV[9], ARGV[6] .. '\\n' .. ARGV[2])
return 1
"""
)

# KEYS: req.  ARGV: id, cancel channel.  Never re-creates a hash that has expired.
CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 'missing' end
if state ~= 'queued' and state ~= 'running' then return state end
redis.call('HSET', KEYS[1], 'cancel', '1')
if state == 'running' then redis.call('PUBLISH', ARGV[2], ARGV[1]) end
return state
"""
