"""Lua shared by the scripts: the shard's keys and helpers (counters, tenant settings,
the concurrency limit, the virtual clock, `sync`), the notices, Redis's clock, the model's keys."""

from __future__ import annotations

# A tenant joining the high band joins this far ahead of the virtual clock: its first
# requests go before the normal band's by up to this many starts at weight 1.
HIGH_BAND_LEAD = 4

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
