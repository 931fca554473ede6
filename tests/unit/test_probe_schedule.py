"""When the replica pool probes a replica (gateway/server/replicas/pool.py's `_probe_due`),
pure logic: one out of rotation, in use or slow to answer is probed every probe interval;
a healthy one this gateway has sent nothing since its last probe only every IDLE_PROBE_S."""

from __future__ import annotations

from gateway.server.replicas import Replica, ReplicaPool
from gateway.server.replicas.pool import IDLE_PROBE_S

PROBED_AT = 100.0
SOON = PROBED_AT + 1.0  # the next probe interval's tick
LATER = PROBED_AT + IDLE_PROBE_S


def _replica(**fields: object) -> Replica:
    replica = Replica(url="a:8001", client=None, max_inflight=8, healthy=True, probed_at=PROBED_AT)
    for name, value in fields.items():
        setattr(replica, name, value)
    return replica


def test_an_idle_healthy_replica_waits_for_the_idle_probe() -> None:
    assert not ReplicaPool._probe_due(_replica(), SOON)
    assert ReplicaPool._probe_due(_replica(), LATER)


def test_a_replica_out_of_rotation_is_probed_every_interval() -> None:
    assert ReplicaPool._probe_due(_replica(healthy=False), SOON)


def test_a_replica_with_requests_in_flight_is_probed_every_interval() -> None:
    assert ReplicaPool._probe_due(_replica(inflight=1), SOON)


def test_a_replica_sent_requests_since_its_last_probe_is_probed_every_interval() -> None:
    assert ReplicaPool._probe_due(_replica(taken=3, taken_at_probe=2), SOON)


def test_a_replica_slow_to_answer_its_last_probe_is_probed_every_interval() -> None:
    assert ReplicaPool._probe_due(_replica(slow_probes=1), SOON)


def test_a_removed_replica_is_not_probed() -> None:
    assert not ReplicaPool._probe_due(_replica(removed=True), LATER)
