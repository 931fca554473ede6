"""Reads of a request in one atomic call: where a queued one stands (QUEUE), its status
fields with its record or standing (READ)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.protocol.redis_keys import Shard
from gateway.server.queue.job import STATUS_FIELDS
from gateway.server.queue.scripts.keys import read_keys, script_json

assert STATUS_FIELDS[-1] == "meta"  # READ puts the payload in its place on an old hash


@dataclass(frozen=True, slots=True)
class Read:
    """A READ or QUEUE call: one request, read (the two take the same arguments)."""

    shard: Shard
    request_id: str

    def keys(self) -> list[str]:
        return read_keys(self.shard, self.request_id)

    def args(self) -> list[str]:
        return [script_json({"prefix": self.shard.prefix, "id": self.request_id})]


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
#   (read_keys).  ARGV: one JSON object (Read.args): prefix, id.
# Where a queued request stands (see _STANDING); false when it is not queued.
QUEUE = (
    _STANDING
    + """
local h = redis.call('HMGET', KEYS[1], 'state', 'model', 'band', 'tenant')
if h[1] ~= 'queued' then return false end
local a = cjson.decode(ARGV[1])
return standing(a.prefix, a.id, h[2], h[3], h[4])
"""
)

# KEYS, ARGV: as QUEUE.
# The request's status fields (STATUS_FIELDS, in that order: never its payload, which can
# be megabytes), in one atomic read with what goes with its state: {fields, the record
# (when it has ended and the results stream still holds it) or false, where it stands
# (when it is queued, see _STANDING) or false}. One read: a request read as queued always
# comes with its place, even when a dispatcher takes it a moment later. A hash written
# before `meta` existed has its payload read in its place (until such requests are gone).
READ = (
    _STANDING
    + "local NAMES = {"
    + ", ".join(f"'{name}'" for name in STATUS_FIELDS)
    + "}\n"
    + """
local h = redis.call('HMGET', KEYS[1], unpack(NAMES))
local f = {}
for i, name in ipairs(NAMES) do f[name] = h[i] end
if not f.state then return {false, false, false} end
if not f.meta then h[#NAMES] = redis.call('HGET', KEYS[1], 'payload') or false end
if f.state == 'queued' then
  local a = cjson.decode(ARGV[1])
  return {h, false, standing(a.prefix, a.id, f.model, f.band, f.tenant)}
end
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
