"""What the gateway and binder processes share at run time: settings common to both,
structured logs, the Redis client and the Redis-stream consumer core, reconnect
policies, and the MongoDB result store."""
