"""The gateway and the binder on a Redis Cluster: three primaries and three replicas on
loopback (each a redis-server started and stopped by pid), six shards over them, several
tenants. The same code as on one Redis: submit -> dispatch -> store -> read across the
shards, streams and long-polls, search (and the index split by tenant over two binders),
rate limits; then a primary killed under load (SIGKILL), its replica promoted by the
cluster itself, and every accepted request accounted for.

Submissions are acknowledged only once a replica has them (REDIS_WAIT_REPLICAS=1), so
the failover loses none; a submission no replica confirmed is refused (503
not_replicated), tested on a Redis without replicas. In front of the session's Triton
and MongoDB (a database of its own)."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import redis
from pymongo import AsyncMongoClient
from redis.asyncio import RedisCluster
from redis.asyncio.cluster import ClusterNode

from gateway.common.redis import RedisClients
from gateway.common.settings import index_partition
from gateway.protocol.redis_keys import Shard, all_shards, shard_for_tenant, shard_of
from gateway.server.tenants.cli import ensure_local_key
from gateway.stack.process import ManagedProcess, free_port, port_is_free, stop_processes, wait_until
from gateway.stack.services import form_redis_cluster, redis_cluster_node_spec
from tests.gateway_calls import TERMINAL, read_events, wait_all
from tests.test_redis_connections import write_while_closed

pytestmark = pytest.mark.timeout(600)

SHARDS = 6  # over 3 primaries: {s0}..{s5} hash to slots of every one of them
NO_REPLICA_DB = 57  # the session Redis (no replicas) database of the not_replicated test
LIMITED = "cl-limited"  # a tenant given a rate limit (its counters in the cluster)


def _cluster_ports(count: int) -> list[int]:
    """Free ports whose cluster bus port (port + 10000) is free as well."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port + 10000 < 65536 and port not in ports and port_is_free(port + 10000):
            ports.append(port)
    return ports


def _tenants() -> list[str]:
    """One tenant per shard (a tenant's requests all live in its shard)."""
    found: dict[int, str] = {}
    n = 0
    while len(found) < SHARDS:
        name = f"cl-{n}"
        found.setdefault(shard_for_tenant(name, SHARDS), name)
        n += 1
    return [found[shard] for shard in sorted(found)]


@dataclass
class Cluster:
    nodes: dict[int, ManagedProcess]  # port -> node
    gateway_url: str
    mongo_url: str
    mongo_db: str
    keys: dict[str, str]  # tenant -> its admin key
    tenants: list[str] = field(default_factory=_tenants)

    @property
    def startup(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.nodes]

    def client(self) -> RedisCluster:
        return RedisCluster(
            startup_nodes=[ClusterNode("127.0.0.1", port) for port in self.nodes], decode_responses=True
        )

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5, decode_responses=True)

    def role(self, port: int) -> dict:
        client = self.node(port)
        try:
            return client.info("replication")
        finally:
            client.close()

    def primary_of(self, shard: Shard) -> int:
        """The port of the primary that holds the shard now (the slot map read afresh)."""
        live = next(port for port, process in self.nodes.items() if process.running)
        client = redis.RedisCluster(host="127.0.0.1", port=live, socket_timeout=5)
        try:
            return int(client.get_node_from_key(shard.backlog).port)
        finally:
            client.close()

    def replica_of(self, primary: int) -> int:
        for port in self.nodes:
            if port != primary and self.nodes[port].running and self.role(port).get("master_port") == primary:
                return port
        raise AssertionError(f"{primary} has no replica")

    def healthy(self) -> bool:
        """Every node up, cluster_state ok, and every primary with a replica in sync."""
        primaries = replicas = 0
        for port, process in self.nodes.items():
            if not process.running:
                return False
            client = self.node(port)
            try:
                if client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    return False
                role = client.info("replication")
            finally:
                client.close()
            if role["role"] == "master":
                primaries += 1
            elif role.get("master_link_status") == "up":
                replicas += 1
        return primaries == 3 and replicas == 3


@pytest.fixture(scope="module")
def cluster(stack, tmp_path_factory) -> Iterator[Cluster]:
    data = tmp_path_factory.mktemp("cluster")
    nodes = {
        port: ManagedProcess(redis_cluster_node_spec(data_dir=data, host="127.0.0.1", port=port, name=f"node-{port}"))
        for port in _cluster_ports(6)
    }
    started: list[ManagedProcess] = []
    try:
        for process in nodes.values():
            process.start()
            started.append(process)
        for process in nodes.values():
            process.wait_ready(time.monotonic() + 60)
        form_redis_cluster([("127.0.0.1", port) for port in nodes], replicas=1)
        mongo_db = f"cluster_test_{secrets.token_hex(4)}"
        keys = {
            tenant: ensure_local_key(data / f"key-{tenant}", stack.mongo_url, mongo_db, tenant=tenant)[0]
            for tenant in [*_tenants(), LIMITED]
        }
        env = {
            "REDIS_CLUSTER_NODES": ",".join(f"127.0.0.1:{port}" for port in nodes),
            "REDIS_SHARDS": str(SHARDS),
            "REDIS_WAIT_REPLICAS": "1",
            # Generous for a busy 2-core machine; a primary without a replica answers after it.
            "REDIS_WAIT_TIMEOUT_MS": "3000",
            "MONGO_DB": mongo_db,
        }
        binder, binder_url = stack.start_binder("binder-cluster", **env)  # the gateway's binder
        started.append(binder)
        gateway, gateway_url = stack.start_gateway("gateway-cluster", BINDER_URLS=binder_url, **env)
        started.append(gateway)
        yield Cluster(nodes, gateway_url, stack.mongo_url, mongo_db, keys)
    finally:
        stop_processes(list(reversed(started)))
        for process in started:
            if process in stack.extra:
                stack.extra.remove(process)


# -- the path across shards -------------------------------------------------------------


EMBED = {"model": "text_embed", "inputs": {"text": "a sentence on a cluster"}}
SHORT_LLM = {"model": "llm_synthetic", "inputs": {"text_input": "cluster", "max_tokens": 8}}
STREAM = {"model": "llm_synthetic", "inputs": {"text_input": "a story", "max_tokens": 24}, "stream": True}


async def _submit(client: httpx.AsyncClient, cluster: Cluster, tenant: str, body: dict) -> str:
    response = await client.post("/infer", json=body, headers=cluster.headers(tenant))
    assert response.status_code == 202, response.text
    return response.json()["request_id"]


async def _stored(cluster: Cluster, ids: list[str], timeout: float = 60) -> dict[str, dict]:
    """The MongoDB documents of these requests, once the binder has stored them all."""
    mongo: AsyncMongoClient = AsyncMongoClient(cluster.mongo_url, tz_aware=True)
    try:
        collection = mongo[cluster.mongo_db]["results"]
        deadline = time.monotonic() + timeout
        while (found := await collection.count_documents({"_id": {"$in": ids}})) < len(ids):
            assert time.monotonic() < deadline, f"{len(ids) - found} of {len(ids)} results never stored"
            await asyncio.sleep(0.3)
        return {doc["_id"]: doc async for doc in collection.find({"_id": {"$in": ids}})}
    finally:
        await mongo.close()


async def test_every_tenants_requests_run_on_its_shard_and_are_stored_and_read_back(cluster: Cluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=60) as client:
        submitted = {
            tenant: [await _submit(client, cluster, tenant, body) for body in (EMBED, SHORT_LLM)]
            for tenant in cluster.tenants
        }
        for tenant, ids in submitted.items():
            client.headers.update(cluster.headers(tenant))
            records = await wait_all(client, ids)
            assert [r["status"] for r in records] == ["succeeded", "succeeded"], records
            assert {shard_of(request_id).index for request_id in ids} == {shard_for_tenant(tenant, SHARDS)}
        ids = [request_id for ids in submitted.values() for request_id in ids]
        stored = await _stored(cluster, ids)
        for tenant, tenant_ids in submitted.items():
            assert {stored[request_id]["tenant"] for request_id in tenant_ids} == {tenant}
            client.headers.update(cluster.headers(tenant))
            read = (await client.get(f"/results/{tenant_ids[0]}")).json()  # the stored record now
            assert read["request_id"] == tenant_ids[0] and len(read["outputs"]["embedding"]) == 384, read
    primaries = {cluster.primary_of(shard) for shard in all_shards(SHARDS)}
    assert len(primaries) == 3  # the shards (and so the tenants) are spread over every primary


async def test_a_tenant_finds_its_embeddings_through_the_binder_of_the_cluster(cluster: Cluster) -> None:
    tenant, other = cluster.tenants[0], cluster.tenants[1]
    body = {"model": "text_embed", "inputs": {"text": "a red bicycle on a cluster"}}
    async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=60) as client:
        mine = await _submit(client, cluster, tenant, body)
        theirs = await _submit(client, cluster, other, body)
        await _stored(cluster, [mine, theirs])
        query = {"text": "a red bicycle on a cluster", "k": 5}
        for _ in range(100):  # the binder indexes what it stored within its follower's next read
            response = await client.post("/search", json=query, headers=cluster.headers(tenant))
            hits = [hit["request_id"] for hit in response.json()["hits"]] if response.status_code == 200 else []
            if mine in hits:
                break
            await asyncio.sleep(0.2)
    assert mine in hits and theirs not in hits, response.text


async def test_streams_and_long_polls_follow_requests_on_every_primary(cluster: Cluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=60) as client:
        for tenant in cluster.tenants:
            client.headers.update(cluster.headers(tenant))
            streamed = await _submit(client, cluster, tenant, STREAM)
            events = await read_events(client, streamed)
            polled = await _submit(client, cluster, tenant, SHORT_LLM)
            answer = (await client.get(f"/results/{polled}", params={"wait": 30})).json()
            record = json.loads(events[-1]["data"])
            tokens = "".join(json.loads(e["data"])["text_output"] for e in events if e["event"] == "token")
            assert events[-1]["event"] == "completed" and tokens == record["outputs"]["text_output"], events
            assert answer["status"] == "succeeded", answer  # one long-poll: woken by the finish


async def test_a_tenants_rate_limit_is_counted_in_the_cluster(cluster: Cluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.gateway_url, headers=cluster.headers(LIMITED), timeout=60) as client:
        limits = {"weight": 1, "limits": {"requests_per_minute": 3}}
        assert (await client.put(f"/admin/tenants/{LIMITED}", json=limits)).status_code == 200
        answers = []
        for _ in range(60):  # the gateway reads the new limits within its cache time
            answers.append(await client.post("/infer", json=SHORT_LLM))
            if answers[-1].status_code == 429:
                break
            await asyncio.sleep(0.2)
    refused = answers[-1]
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited", refused.text
    assert refused.headers["x-ratelimit-limit-requests"] == "3" and refused.headers["retry-after"]


async def test_a_write_on_a_node_connection_closed_under_it_is_a_connection_error(cluster: Cluster) -> None:
    """The cluster client closes a node's connections, those in use too, after a failure
    (tests/test_redis_connections.py): the nodes it reads from the slot map and the
    plain clients of the readers make connections whose closed writes are retried."""
    clients = RedisClients.open(
        url="", cluster_nodes=[f"127.0.0.1:{port}" for port in cluster.nodes], timeout_s=2, max_connections=8
    )
    reader = await clients.reader(Shard(0))
    try:
        node = clients.main.get_node_from_key(Shard(0).backlog)
        for connection in (node.acquire_connection(), reader.connection_pool.make_connection()):
            failed = await write_while_closed(connection, wait_closed=False)
            assert isinstance(failed, redis.exceptions.ConnectionError), repr(failed)
    finally:
        await reader.aclose()
        await clients.aclose()


# -- the index past one binder: partitions by tenant -----------------------------------------


async def _indexed(binder_url: str) -> int:
    async with httpx.AsyncClient(timeout=10) as client:
        health = (await client.get(f"{binder_url}/healthz")).json()
    return int(health.get("index", {}).get("minilm", 0))


async def test_binders_split_the_index_by_tenant_and_searches_go_to_the_tenants_binder(cluster: Cluster, stack) -> None:
    env = {
        "REDIS_CLUSTER_NODES": ",".join(cluster.startup),
        "REDIS_SHARDS": str(SHARDS),
        "MONGO_DB": cluster.mongo_db,
        "INDEX_PARTITIONS": "2",
    }
    binders = [stack.start_binder(f"binder-part-{n}", INDEX_PARTITION=str(n), **env) for n in (0, 1)]
    gateway, url = stack.start_gateway("gateway-part", BINDER_URLS=",".join(u for _, u in binders), **env)
    partition = {tenant: index_partition(tenant, 2) for tenant in cluster.tenants}
    assert set(partition.values()) == {0, 1}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"model": "text_embed", "inputs": {"text": "a lighthouse in the fog"}}
            mine = {tenant: await _submit(client, cluster, tenant, body) for tenant in cluster.tenants}
            await _stored(cluster, list(mine.values()))
            for tenant, request_id in mine.items():
                query = {"text": "a lighthouse in the fog", "k": 3}
                for _ in range(100):  # indexed within the follower's next read
                    response = await client.post("/search", json=query, headers=cluster.headers(tenant))
                    hits = [h["request_id"] for h in response.json()["hits"]] if response.status_code == 200 else []
                    if request_id in hits:
                        break
                    await asyncio.sleep(0.2)
                others = set(mine.values()) - {request_id}  # the other tenants' twins of it
                assert request_id in hits and not others & set(hits), response.text
        # Each binder holds exactly its partition's tenants' embeddings (MongoDB's count).
        mongo: AsyncMongoClient = AsyncMongoClient(cluster.mongo_url)
        try:
            results = mongo[cluster.mongo_db]["results"]
            for n, (_, binder_url) in enumerate(binders):
                tenants = [t for t, p in partition.items() if p == n]
                expected = await results.count_documents({"model": "text_embed", "tenant": {"$in": tenants}})
                for _ in range(150):
                    if (indexed := await _indexed(binder_url)) == expected:
                        break
                    await asyncio.sleep(0.2)
                assert indexed == expected, (n, indexed, expected)
        finally:
            await mongo.close()
        async with httpx.AsyncClient(timeout=10) as client:  # a tenant of the other partition: misdirected
            other = next(t for t, p in partition.items() if p == 1)
            wrong = await client.post(
                f"{binders[0][1]}/search", json={"space": "minilm", "vector": [0.1] * 384, "tenant": other}
            )
        assert wrong.status_code == 421 and wrong.json()["code"] == "wrong_partition"
    finally:
        for process, _ in [*binders, (gateway, url)]:
            stack.stop(process)


# -- WAIT: acknowledged only once a replica has it ----------------------------------------


@pytest.fixture(scope="module")
def gateway_without_replicas(stack) -> Iterator[str]:
    """A gateway that asks for a replica's confirmation on a Redis that has none."""
    process, url = stack.start_gateway(
        "gateway-no-replica",
        REDIS_URL=stack.redis_db_url(NO_REPLICA_DB),
        REDIS_WAIT_REPLICAS="1",
        REDIS_WAIT_TIMEOUT_MS="50",
    )
    yield url
    stack.stop(process)


async def test_a_submission_no_replica_confirms_is_refused_and_found_again_by_its_idempotency_key(
    gateway_without_replicas: str,
) -> None:
    from tests.conftest import AUTH

    async with httpx.AsyncClient(base_url=gateway_without_replicas, headers=AUTH, timeout=60) as client:
        key = {"Idempotency-Key": f"unreplicated-{secrets.token_hex(4)}"}
        refused = await client.post("/infer", json=SHORT_LLM, headers=key)
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        error = refused.json()["error"]
        assert error["code"] == "not_replicated" and error["details"]["replicas"] == 0, error
        request_id = error["details"]["request_ids"][0]
        again = await client.post("/infer", json=SHORT_LLM, headers=key)
        assert again.status_code == 202 and again.json()["request_id"] == request_id, again.text
        # Written to the primary, it runs (and is not queued twice).
        record = (await client.get(f"/results/{request_id}", params={"wait": 30})).json()
        assert record["status"] == "succeeded" and record["attempts"] >= 1, record


# -- a primary killed under load -----------------------------------------------------------


DEADLINE_S = 120
BODIES = [
    {"model": "llm_synthetic", "inputs": {"text_input": "failover stream", "max_tokens": 30}, "stream": True},
    {"model": "text_embed", "inputs": {"text": "a sentence across a failover"}},
    {"model": "llm_echo", "inputs": {"text_input": "echo 👋 世界 é", "max_tokens": 40}, "stream": True},
    {"model": "llm_synthetic", "inputs": {"text_input": "short", "max_tokens": 6}},
]
# While its primary is down (a second or two), a shard's submissions are refused with one
# of these; the other shards go on.
ALLOWED_REFUSALS = {(503, "redis_unavailable"), (503, "not_replicated")}
TERMINAL_EVENTS = {"completed", "failed", "canceled", "expired"}


@dataclass
class Load:
    accepted: dict[str, str] = field(default_factory=dict)  # request id -> tenant
    streamed: set[str] = field(default_factory=set)
    followed: dict[str, list[dict]] = field(default_factory=dict)  # request id -> its SSE events
    resumed: int = 0  # followed streams that had to reconnect (Last-Event-ID)
    refused: Counter = field(default_factory=Counter)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


async def _follow(cluster: Cluster, load: Load, tenant: str, request_id: str) -> None:
    """A client that watches the stream live, from its submission to its end, and like
    any EventSource reconnects with Last-Event-ID when the connection is refused or cut."""
    events: list[dict] = []
    deadline = time.monotonic() + DEADLINE_S
    async with httpx.AsyncClient(base_url=cluster.gateway_url, headers=cluster.headers(tenant), timeout=60) as client:
        while not events or events[-1]["event"] not in TERMINAL_EVENTS:
            assert time.monotonic() < deadline, f"{request_id}: the stream did not end"
            last = {"Last-Event-ID": events[-1]["id"]} if events else {}
            try:
                events += await read_events(client, request_id, last_event_id=last.get("Last-Event-ID"))
            except (AssertionError, httpx.TransportError):  # 503 while its shard fails over
                load.resumed += 1
                await asyncio.sleep(0.2)
    load.followed[request_id] = events


async def _submit_one(cluster: Cluster, load: Load, client: httpx.AsyncClient, tenant: str, body: dict) -> None:
    try:
        response = await client.post("/infer", json=body, headers=cluster.headers(tenant))
    except httpx.TransportError:
        load.refused[("connection", "")] += 1
        return
    if response.status_code != 202:
        load.refused[(response.status_code, response.json()["error"]["code"])] += 1
        return
    request_id = response.json()["request_id"]
    load.accepted[request_id] = tenant
    if body.get("stream"):
        load.streamed.add(request_id)
        if len(load.streamed) % 2:
            await _follow(cluster, load, tenant, request_id)


async def _load(cluster: Cluster, load: Load, stop: asyncio.Event, rate: float = 12.0) -> None:
    """Submissions at random times, each on its own: one stalled shard holds up no other."""
    rng = random.Random(7)
    async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=30) as client:
        while not stop.is_set():
            body = {**rng.choice(BODIES), "timeout_s": DEADLINE_S}
            load.tasks.append(
                asyncio.create_task(_submit_one(cluster, load, client, rng.choice(cluster.tenants), body))
            )
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*load.tasks)


async def _drain(cluster: Cluster, load: Load, bound_s: float) -> dict[str, dict]:
    """Every accepted request's terminal record (long-polls), within the bound."""
    records: dict[str, dict] = {}
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=cluster.gateway_url, timeout=30) as client:

        async def one(request_id: str, tenant: str) -> None:
            while time.monotonic() - started < bound_s:
                response = await client.get(
                    f"/results/{request_id}", params={"wait": 5}, headers=cluster.headers(tenant)
                )
                if response.status_code == 200 and response.json()["status"] in TERMINAL:
                    records[request_id] = response.json()
                    return

        await asyncio.gather(*(one(rid, tenant) for rid, tenant in load.accepted.items()))
    return records


async def _finishes(cluster: Cluster, ids: set[str]) -> Counter:
    """How often each request was finished: its entries in the shards' results streams."""
    client = cluster.client()
    try:
        counts: Counter = Counter()
        for shard in all_shards(SHARDS):
            for _, fields in await client.xrange(shard.results):
                if fields.get("id") in ids:
                    counts[fields["id"]] += 1
        return counts
    finally:
        await client.aclose()


def _joined_tokens(events: list[dict]) -> tuple[list[int], str]:
    tokens = [json.loads(e["data"]) for e in events if e["event"] == "token"]
    return [t["index"] for t in tokens], "".join(t["text_output"] for t in tokens)


def _contiguous(events: list[dict]) -> list[int]:
    expected, indexes = 0, []
    for event in events:
        if event["event"] == "token":
            indexes.append(expected)
            expected += json.loads(event["data"])["count"]
    return indexes


async def test_a_primary_killed_under_load_loses_and_repeats_no_accepted_request(cluster: Cluster) -> None:
    assert wait_until(cluster.healthy, 60)
    # The primary holding the most tenants' shards, and its replica.
    holders = Counter(cluster.primary_of(Shard(shard_for_tenant(t, SHARDS))) for t in cluster.tenants)
    victim_port = holders.most_common(1)[0][0]
    heir_port = cluster.replica_of(victim_port)
    victim = cluster.nodes[victim_port]

    load, stop = Load(), asyncio.Event()
    loading = asyncio.create_task(_load(cluster, load, stop))
    await asyncio.sleep(6)
    before = len(load.accepted)
    killed_at = time.monotonic()
    victim.kill()  # SIGKILL: no AOF flush, no goodbye to its replica
    promoted = await asyncio.to_thread(wait_until, lambda: cluster.role(heir_port)["role"] == "master", 60)
    failover_s = time.monotonic() - killed_at
    assert promoted, "the replica was not promoted"
    await asyncio.sleep(2)  # load on the promoted primary, which has no replica yet
    await asyncio.to_thread(victim.start)  # the same port and directory: it rejoins as a replica
    await asyncio.to_thread(victim.wait_ready, time.monotonic() + 60)
    assert await asyncio.to_thread(wait_until, cluster.healthy, 60), "the cluster did not heal"
    healed_s = time.monotonic() - killed_at
    await asyncio.sleep(4)  # load goes on on the healed cluster
    stop.set()
    await loading  # every submission answered, every followed stream ended

    records = await _drain(cluster, load, bound_s=DEADLINE_S + 60)
    ids = list(load.accepted)
    stored = await _stored(cluster, ids, timeout=90)
    finishes = await _finishes(cluster, set(ids))
    report = {
        "accepted": len(ids),
        "accepted_before_kill": before,
        "terminal": len(records),
        "stored": len(stored),
        "lost": len(set(ids) - set(records)),
        "duplicated": sum(n - 1 for n in finishes.values() if n > 1),
        "unfinished_in_streams": len(set(ids) - set(finishes)),
        "statuses": dict(Counter(r["status"] for r in records.values())),
        "followed_streams": len(load.followed),
        "followed_streams_resumed": load.resumed,
        "refused": {f"{k[0]} {k[1]}".strip(): v for k, v in load.refused.items()},
        "failover_s": round(failover_s, 1),
        "healed_s": round(healed_s, 1),
    }
    print(json.dumps(report))
    assert set(load.refused) <= ALLOWED_REFUSALS, report
    assert report["lost"] == 0 and report["stored"] == len(ids) and report["duplicated"] == 0, report
    assert report["unfinished_in_streams"] == 0, report
    assert set(report["statuses"]) == {"succeeded"}, report
    for request_id, events in load.followed.items():
        indexes, text = _joined_tokens(events)
        assert events[-1]["event"] == "completed", (request_id, events[-1])
        assert indexes == _contiguous(events), (request_id, indexes)
        assert text == stored[request_id]["outputs"]["text_output"], request_id
