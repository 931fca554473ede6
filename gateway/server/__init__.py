"""The gateway service (`gateway serve`): the HTTP API, and in the same process the
dispatcher that takes queued requests, runs them on Triton replicas and finishes them.

Rooms: api/ (routes), queue/ (requests as durable jobs in Redis), dispatch/ (taking
and running work), replicas/ (the Triton pool and routing), models/ (the model registry),
results/ (reading outcomes, waking waiters), search/ (similarity search via binders)."""
