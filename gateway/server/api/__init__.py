"""HTTP routes, one module per group: submit, results (poll, long-poll, cancel), events
(SSE), search, operations (health, readiness, metrics, models)."""
