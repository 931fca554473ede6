"""The Lua scripts behind every change of a request's state.

Each script runs over one shard (gateway.protocol.redis_keys), and every key it knows
before it runs arrives in KEYS, in the order the functions below (shard_keys, model_keys,
tenant_keys, request_keys, ...) list them: Redis Cluster routes the call by them and,
while a slot migrates, redirects or retries it on them. The keys a script can only find
as it runs (the request TAKE starts and the queue of the tenant it picks, the requests
RECLAIM finds due, the ready sets a tenant's run unblocks, a queued request's queue) are
built inside from the shard's prefix (`prefix`, in the call's JSON argument); all of a
shard's keys carry its hash tag, so they live in its slot (docs/deployment.md: moving a
slot safely).

Each call is a frozen dataclass beside its script (Submit, Take, Emit, Renew, Reclaim,
Handover, Finish, Cancel, Follow, Read): it gives the call's KEYS and its fields as one
JSON argument (keys.script_json) that the script decodes with cjson and reads by name.
What a script stores without reading (SUBMIT's payloads, FINISH's record) follows as
arguments of their own. SUBMIT and FINISH are made for many items: a head (the shard's
keys, one JSON argument) and then each item's keys and arguments, so the group commit
merges the calls ready together by appending their items (gateway/common/redis.py).

Each script is atomic and idempotent: replayed after a lost reply (the client retries on
connection errors) it changes nothing more. A replay of SUBMIT or FINISH that finds its
own earlier write still makes a write (`sync`, a key of the shard that lives a second):
the WAIT that follows it on the new connection then covers the write it found (WAIT
counts only the writes of its own connection; a connection that wrote nothing would be
confirmed at once, whatever the replicas hold).

Runs are fenced by a random run token: TAKE (or SUBMIT, starting at once) writes the
run's token into the request's hash (`run`), and EMIT, RENEW, HANDOVER and FINISH refuse
any other, so a dispatcher that lost its request to another can neither publish, nor
keep, hand on or finish it. The attempt number (`attempts`, one more at each start) is
for display, resuming and the delivery limit only: after a failover that lost a TAKE it
is handed out again, a token never is. A hand-over (a draining gateway passing its run
on) is counted apart (`handovers`): the delivery limit counts attempts less hand-overs.

The queue: a request waits in its tenant's list `q:<model>:<band>:<tenant>`; tenants with
waiting work are members of `ready:<model>:<band>`, scored by virtual time (start-time
fair queuing: a tenant's score grows by 1/weight with each request it starts; a tenant
that becomes ready joins at the current virtual time). The high and normal bands share
one virtual clock (`clock`) and are served by score across both: a tenant joining the
high band (a grant: api/admin.py) joins HIGH_BAND_LEAD ahead of the clock, so its
requests go first while it is within its share, and a flood of them gets the tenant its
share and no more (each start moves its score in both bands). The low band is served
when neither holds a tenant to serve, the batch band after all. One decision costs
O(log tenants)."""

from gateway.server.queue.scripts.finish import FINISH, FINISH_HEAD, FINISH_MOST, Finish, FinishItem
from gateway.server.queue.scripts.keys import (
    finish_keys,
    handover_keys,
    lease_keys,
    model_keys,
    read_keys,
    reclaim_keys,
    request_keys,
    shard_keys,
    tenant_keys,
)
from gateway.server.queue.scripts.reads import QUEUE, READ, Read
from gateway.server.queue.scripts.runs import (
    CANCEL,
    EMIT,
    FOLLOW,
    HANDOVER,
    RECLAIM,
    RENEW,
    Cancel,
    Emit,
    Follow,
    Handover,
    Reclaim,
    Renew,
    renew_call,
)
from gateway.server.queue.scripts.shared import HIGH_BAND_LEAD, NOTICES_KEPT
from gateway.server.queue.scripts.submit import SUBMIT, SUBMIT_HEAD, SUBMIT_MOST, Submission, Submit
from gateway.server.queue.scripts.take import TAKE, Take

__all__ = [
    "CANCEL",
    "EMIT",
    "FINISH",
    "FINISH_HEAD",
    "FINISH_MOST",
    "FOLLOW",
    "HANDOVER",
    "HIGH_BAND_LEAD",
    "NOTICES_KEPT",
    "QUEUE",
    "READ",
    "RECLAIM",
    "RENEW",
    "SUBMIT",
    "SUBMIT_HEAD",
    "SUBMIT_MOST",
    "TAKE",
    "Cancel",
    "Emit",
    "Finish",
    "FinishItem",
    "Follow",
    "Handover",
    "Read",
    "Reclaim",
    "Renew",
    "Submission",
    "Submit",
    "Take",
    "finish_keys",
    "handover_keys",
    "lease_keys",
    "model_keys",
    "read_keys",
    "reclaim_keys",
    "renew_call",
    "request_keys",
    "shard_keys",
    "tenant_keys",
]
