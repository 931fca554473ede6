"""Requests as durable jobs in Redis: the hash `req:<id>` (state, payload, attempt), an
entry in its queue stream, and the event stream `events:<id>`. Every change of state is
one Lua script, so it is atomic and safe to replay."""
