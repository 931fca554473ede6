"""The local stack (`gateway up`): Triton from the pytriton wheel, Redis, the MongoDB-wire
server, the binder and the gateway, started in order, supervised, and stopped by pid.
Not part of the gateway's runtime: it builds demo models (torch) and manages processes."""
