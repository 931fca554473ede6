// MongoDB health check that also initialises the replica set, once.
// The gateways and binders connect with ?replicaSet=rs0: retryable writes need a replica
// set, and a single node is enough. The member is named by its compose service address so
// that drivers in other containers can reach it. Exits non-zero until this node is primary.
try {
  rs.status();
} catch (e) {
  if (e.codeName !== "NotYetInitialized") {
    throw e;
  }
  rs.initiate({ _id: "rs0", members: [{ _id: 0, host: "mongo:27017" }] });
}
if (!db.hello().isWritablePrimary) {
  quit(1);
}
