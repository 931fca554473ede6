"""Taking accepted requests from the queues and running them on Triton replicas: the
dispatcher (reading fairly, reclaiming from dead peers, fencing), the runner (one
request: replica choice, retries, streaming), the sweeper (deadlines, trimming)."""
