"""The Triton replicas: one long-lived gRPC client each, health probes, and the choice of
replica for each request."""

from gateway.server.replicas.pool import Replica, ReplicaPool

__all__ = ["Replica", "ReplicaPool"]
