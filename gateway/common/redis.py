"""Redis clients with bounded pools and socket timeouts: a Redis that stops answering
fails a call instead of hanging it.

One Redis (REDIS_URL) or a Redis Cluster (REDIS_CLUSTER_NODES), behind one interface:
- `main`: commands and scripts (redis-py's asyncio client, or its RedisCluster client,
  which sends each command to the node holding its keys' slot, follows MOVED and
  re-reads the slot map after a failover);
- `replicated(script, keys, args)`: a script, then WAIT on the same connection (WAIT
  counts the replicas that have the writes of *its own* connection), on the node that
  holds the keys: how a write is made durable across a failover (REDIS_WAIT_REPLICAS);
- `group`: on one Redis, the script calls made while one is in flight go to Redis as one
  pipeline (a call made while nothing is pending goes at once), the calls of a script
  made for many items (SUBMIT, FINISH) merged into one (GroupCommit; REDIS_GROUP_COMMIT),
  each caller with its own reply;
- `subscription()`: a connection for SUBSCRIBE (in a cluster, to any node: a PUBLISH,
  from a script too, reaches every node);
- `reader(shard)`: one connection to the node holding a shard, for blocking reads
  (XREAD BLOCK), whose timeout exceeds the longest block; `unblocker()` the client that
  interrupts those reads (CLIENT UNBLOCK on the reader's own node);
- `sync_client()`: a synchronous client of the same Redis or cluster, with connections of
  its own, for a thread that must not depend on the event loop (the lease keeper,
  gateway/server/dispatch/leases.py).

Connection errors are retried a few times with backoff (the asyncio Retry class, on the
asyncio clients): every script is idempotent, so a command replayed after a lost reply
changes nothing more. A write on a connection that another task closed under it (the
cluster client closes a node's connections after a failure) is such an error too, not the
AttributeError or RuntimeError redis-py lets out (_ClosedWriteIsConnectionError)."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import redis as sync_redis
import redis.cluster as sync_cluster
import redis.retry as sync_retry
from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    OutOfMemoryError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.protocol.redis_keys import Shard

log = logging.getLogger(__name__)

# The longest BLOCK any reader asks for; blocking clients wait this much longer.
MAX_BLOCK_MS = 2000

# Redis out of reach, or (Cluster) a slot without a serving primary, between a primary's
# failure and its replica's promotion: the callers retry.
REDIS_OUTAGE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError, ClusterDownError, TryAgainError)


def is_redis_full(exc: BaseException) -> bool:
    """Whether Redis refused a write at its maxmemory (noeviction): a command's own
    OutOfMemoryError (redis-py drops the reply's OOM prefix), or a script's write refused
    inside it (a ResponseError naming the OOM reply)."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and "OOM command not allowed" in str(exc)
    )


def waits_for_redis(exc: BaseException) -> bool:
    """Whether a write that failed so is tried again once Redis is back or has room: an
    outage, or Redis at its maxmemory (room comes back as results are stored and expire)."""
    return isinstance(exc, REDIS_OUTAGE) or is_redis_full(exc)


# Slot map refreshes are coalesced: at most one in this long.
_REFRESH_EVERY_S = 0.2
# Client ids of blocking readers remembered (a reader per shard and process, reconnecting now and then).
_READER_IDS_KEPT = 4096


class NotReplicated(RedisError):
    """A write reached its primary, but fewer replicas than REDIS_WAIT_REPLICAS confirmed it
    within REDIS_WAIT_TIMEOUT_MS: a failover now could lose it."""

    def __init__(self, acked: int, wanted: int, timeout_ms: int, request_ids: Sequence[str] = ()) -> None:
        super().__init__(f"{acked} of {wanted} replica(s) confirmed the write within {timeout_ms} ms")
        self.acked, self.wanted, self.request_ids = acked, wanted, list(request_ids)


def _retry() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), 3)


class _ClosedWriteIsConnectionError(AbstractConnection):
    """A write on a connection that another task closed meanwhile is a connection error,
    retried like one. redis-py 7 lets out what the closed writer raised instead
    (redis/redis-py#4287): AttributeError ('NoneType' ... 'writelines') once the writer is
    gone, or uvloop's RuntimeError ('unable to perform operation on <TCPTransport
    closed=True>') while it closes. Either way the connection is closed by then (redis-py
    disconnects it on any failed write). 8.x converts these itself, but is not used here
    (pyproject.toml: a cancelled XREAD BLOCK hangs there)."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await self._send_here(command, check_health)
        except AttributeError as exc:
            if "'NoneType'" not in str(exc):
                raise
            raise RedisConnectionError(f"the connection was closed while writing to it ({exc})") from exc
        except RuntimeError as exc:
            if "closed" not in str(exc):
                raise
            raise RedisConnectionError(f"the connection was closed while writing to it ({exc})") from exc

    async def can_read_destructive(self) -> bool:
        """Whether a connection taken from the pool holds data nobody asked for (a reply a
        call cut short left; the pool then connects it again) or is closed, looked at
        without waiting: redis-py's waits a turn of the loop (a timeout of 0) on every
        checkout. What the socket has, the transport has read into the stream by then."""
        stream, parser = self._reader, self._parser
        if stream is None or not getattr(parser, "_connected", True):
            return await super().can_read_destructive()  # (raises as redis-py's does)
        pending = getattr(parser, "_reader", None)  # hiredis's reader: bytes fed, not taken
        if pending is not None and pending.has_data():
            return True
        return bool(getattr(parser, "_buffer", None) or stream._buffer) or stream.at_eof()

    async def _send_here(self, command: Any, check_health: bool) -> None:
        """redis-py's send_packed_command, its write bounded by asyncio.timeout in the
        caller's task: redis-py's wait_for makes a task of every write on Python 3.11."""
        if not self.is_connected:
            await self.connect_check_health(check_health=False)
        if check_health:
            await self.check_health()
        try:
            if isinstance(command, str):
                command = command.encode()
            if isinstance(command, bytes):
                command = [command]
            if self.socket_timeout:
                async with asyncio.timeout(self.socket_timeout):
                    await self._send_packed_command(command)
            else:
                self._writer.writelines(command)
                await self._writer.drain()
        except TimeoutError:  # (before OSError, of which it is one)
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)
            number, message = ("UNKNOWN", exc.args[0]) if len(exc.args) == 1 else (exc.args[0], exc.args[1])
            raise RedisConnectionError(f"Error {number} while writing to socket. {message}.") from exc
        except BaseException:
            # A write cut short (cancelled) cannot be sent again: the connection goes, as redis-py's.
            await self.disconnect(nowait=True)
            raise


@functools.cache
def _guarded(connection_class: type[AbstractConnection]) -> type[AbstractConnection]:
    """connection_class (TCP, TLS or Unix socket), its closed writes made connection errors."""
    if issubclass(connection_class, _ClosedWriteIsConnectionError):
        return connection_class
    return type(connection_class.__name__, (_ClosedWriteIsConnectionError, connection_class), {})


def _guard(client: Redis) -> Redis:
    """The client, its pool making _guarded connections (none is made before the first command)."""
    pool = client.connection_pool
    pool.connection_class = _guarded(pool.connection_class)
    return client


def _guard_cluster(client: RedisCluster) -> RedisCluster:
    """The cluster client, every node's connections _guarded: the nodes made so far and
    those its slot map adds later (made from the same connection settings)."""
    client.connection_kwargs["connection_class"] = _guarded(client.connection_kwargs["connection_class"])
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = _guarded(node.connection_class)
    return client


def connect(url: str, *, timeout_s: float, max_connections: int, blocking: bool = False) -> Redis:
    """A client whose commands fail after timeout_s (plus the block time for blocking
    readers) and whose pool holds at most max_connections (callers wait for one)."""
    socket_timeout = timeout_s + (MAX_BLOCK_MS / 1000 if blocking else 0)
    pool = BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        timeout=timeout_s,  # waiting for a free connection
        socket_timeout=socket_timeout,
        socket_connect_timeout=min(timeout_s, 2.0),
        health_check_interval=30,
        retry=_retry(),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    return _guard(Redis.from_pool(pool))  # closing the client closes its pool


def _node(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


def credentials(url: str) -> dict[str, Any]:
    """The username, password and TLS of a redis:// or rediss:// URL: in a cluster,
    REDIS_URL's credentials apply to every node (its host is not used)."""
    parts = urlsplit(url)
    found: dict[str, Any] = {"ssl": parts.scheme == "rediss"}
    if parts.username:
        found["username"] = unquote(parts.username)
    if parts.password:
        found["password"] = unquote(parts.password)
    return found


@dataclass
class _Call:
    script: AsyncScript
    keys: list[Any]
    args: list[Any]
    answer: asyncio.Future[Any]


# A merged call carries at most this many bytes of arguments (an item larger goes alone):
# a script runs alone in Redis, and one of many large payloads would hold it up for long.
MERGED_MOST_BYTES = 1024 * 1024


def _size(args: list[Any]) -> int:
    return sum(len(arg) for arg in args if isinstance(arg, str | bytes))


def _batches(group: list[_Call], args: int, most: int) -> list[list[_Call]]:
    """The calls of a group in merged calls of at most `most` items and MERGED_MOST_BYTES."""
    out: list[list[_Call]] = [[]]
    size = 0
    for call in group:
        item = _size(call.args[args:])
        if out[-1] and (len(out[-1]) >= most or size + item > MERGED_MOST_BYTES):
            out.append([])
            size = 0
        out[-1].append(call)
        size += item
    return out


def _merged(calls: list[_Call]) -> list[_Call]:
    """Calls of a script made for many items (its `head`: the numbers of keys and arguments
    its items share, then each item's own; its reply: one per item) that share their head
    become one call of at most its `most` items and MERGED_MOST_BYTES of their arguments;
    each caller gets its own item's reply, as [reply], as if it had called alone."""
    out: list[_Call] = []
    groups: dict[tuple[Any, ...], tuple[tuple[int, int], list[_Call]]] = {}
    for call in calls:
        head: tuple[int, int] | None = getattr(call.script, "head", None)
        if head is None:
            out.append(call)
            continue
        keys, args = head
        groups.setdefault((id(call.script), *call.keys[:keys], *call.args[:args]), (head, []))[1].append(call)
    for (keys, args), group in groups.values():
        first = group[0]
        for members in _batches(group, args, getattr(first.script, "most", len(group))):
            if len(members) == 1:
                out.append(members[0])
                continue
            merged = _Call(
                first.script,
                first.keys[:keys] + [key for m in members for key in m.keys[keys:]],
                first.args[:args] + [arg for m in members for arg in m.args[args:]],
                first.answer.get_loop().create_future(),
            )
            merged.answer.add_done_callback(functools.partial(_split, members=members))
            out.append(merged)
    return out


def _split(answer: asyncio.Future[Any], members: list[_Call]) -> None:
    """A merged call's answer, item by item to its callers (a WAIT's count to each)."""
    if answer.cancelled():
        for member in members:
            member.answer.cancel()
        return
    failed = answer.exception()
    if failed is not None:
        for member in members:
            _answer(member, failed)
        return
    reply = answer.result()
    waited = isinstance(reply, tuple)
    items, acked = reply if waited else (reply, None)
    for member, item in zip(members, items, strict=True):
        _answer(member, ([item], acked) if waited else [item])


class GroupCommit:
    """Script calls made while one is in flight go to Redis as one pipeline: a
    round trip costs the client tens of µs of CPU whatever it carries (an EVALSHA ~95 µs
    alone, ~15 µs in a pipeline of 32: docs/benchmarks.md), so calls that are ready
    together pay it once; calls of a script made for many items (SUBMIT, FINISH) that are ready
    together become one call (_merged). Each caller gets its own reply or error, as if it
    had called alone. Calls to be replicated go in a pipeline of their own that ends with one WAIT
    (WAIT counts the writes of its connection, so one covers them all); the others are not
    held up by it. One Redis only (a cluster's calls go to their own nodes).

    A call made while nothing is pending (no pipeline in flight, none gathering) is sent at
    once from its caller's own task: no task, no timer, no yield. Calls made while one is in
    flight gather for a sender task, which sends them all in the next turn (so a caller
    that stops waiting cannot take the others' calls down with it): the first call of a
    turn may go alone, the rest of that turn's go together."""

    def __init__(self, client: Redis, *, wait_replicas: int = 0, wait_timeout_ms: int = 250) -> None:
        self.client = client
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._ready: dict[bool, list[_Call]] = {False: [], True: []}
        self._in_flight: dict[bool, int] = {False: 0, True: 0}  # pipelines sent, not yet answered
        self._sending: set[asyncio.Task[None]] = set()

    async def call(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any], *, wait: bool = False) -> Any:
        """The script's reply; wait: (its reply, the replicas that confirmed the writes
        within wait_timeout_ms) — with wait_replicas 0, (its reply, None)."""
        if wait and not self.wait_replicas:
            return await self.call(script, keys, args), None
        call = _Call(script, list(keys), list(args), asyncio.get_running_loop().create_future())
        ready = self._ready[wait]
        if not ready and not self._in_flight[wait]:
            # Nothing pending: sent from the caller's own task at once (the calls made while
            # it is in flight gather for a sender).
            await self._send([call], wait)
            return call.answer.result()
        ready.append(call)
        if len(ready) == 1:  # the first to gather: a sender, whose first step is the next turn
            task = asyncio.get_running_loop().create_task(self._flush(wait))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return await call.answer  # (cancelled, its caller stopped waiting: not sent)

    async def _flush(self, wait: bool) -> None:
        # A call whose caller stopped waiting before it was sent is not sent: nobody would
        # learn its outcome (a submission the client gave up on is not made).
        live = [call for call in self._ready[wait] if not call.answer.done()]
        calls, self._ready[wait] = _merged(live), []
        if calls:
            await self._send(calls, wait)

    async def _send(self, calls: list[_Call], wait: bool) -> None:
        self._in_flight[wait] += 1
        try:
            for attempt in range(2):
                async with self.client.pipeline(transaction=False) as pipe:
                    for call in calls:
                        pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
                    if wait:
                        pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
                    replies = await pipe.execute(raise_on_error=False)
                acked: Any = replies.pop() if wait else None
                unknown = [c for c, r in zip(calls, replies, strict=True) if isinstance(r, NoScriptError)]
                for call, reply in zip(calls, replies, strict=True):
                    if attempt == 0 and isinstance(reply, NoScriptError):
                        continue  # loaded below, then sent again
                    if wait and not isinstance(reply, Exception):
                        reply = acked if isinstance(acked, Exception) else (reply, int(acked))
                    _answer(call, reply)
                if not unknown or attempt == 1:
                    return
                for script in {id(c.script): c.script for c in unknown}.values():  # a restarted Redis
                    await self.client.script_load(script.script)
                calls = unknown
        except BaseException as exc:  # the pipeline did not get through: every caller left learns why
            for call in calls:
                _answer(call, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._in_flight[wait] -= 1


def _answer(call: _Call, reply: Any) -> None:
    if call.answer.done():  # the caller stopped waiting
        return
    if isinstance(reply, BaseException):
        call.answer.set_exception(reply)
    else:
        call.answer.set_result(reply)


@dataclass
class RedisClients:
    """The Redis clients of one process (see the module docstring)."""

    main: Any  # Redis | RedisCluster (typed loosely: their command sets differ only in routing)
    url: str = ""
    cluster: bool = False
    timeout_s: float = 5.0
    max_connections: int = 256
    # WAIT after replicated() scripts: for this many replicas (0: no WAIT), this long.
    wait_replicas: int = 0
    wait_timeout_ms: int = 250
    auth: dict[str, Any] = field(default_factory=dict)  # cluster: credentials() of REDIS_URL
    nodes: list[str] = field(default_factory=list)  # cluster: REDIS_CLUSTER_NODES
    # Cluster: a pooled plain client per node (replicated scripts), and which nodes the
    # blocking readers with a given client id are connected to (client ids are per node).
    _nodes: dict[tuple[str, int], Redis] = field(default_factory=dict)
    _reader_nodes: dict[int, set[tuple[str, int]]] = field(default_factory=dict)
    _refreshed_at: float = 0.0
    # One Redis: script calls of one loop turn in one pipeline (None: each call alone).
    group: GroupCommit | None = None

    @classmethod
    def open(
        cls,
        *,
        url: str,
        cluster_nodes: list[str],
        timeout_s: float,
        max_connections: int,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 250,
        group_commit: bool = True,
    ) -> RedisClients:
        if not cluster_nodes:
            main = connect(url, timeout_s=timeout_s, max_connections=max_connections)
            group = GroupCommit(main, wait_replicas=wait_replicas, wait_timeout_ms=wait_timeout_ms)
            return cls(
                main=main,
                url=url,
                timeout_s=timeout_s,
                max_connections=max_connections,
                wait_replicas=wait_replicas,
                wait_timeout_ms=wait_timeout_ms,
                group=group if group_commit else None,
            )
        auth = credentials(url) if url else {}
        main = _guard_cluster(
            RedisCluster(
                startup_nodes=[ClusterNode(*_node(n)) for n in cluster_nodes],
                **auth,
                decode_responses=True,
                socket_timeout=timeout_s,
                socket_connect_timeout=min(timeout_s, 2.0),
                max_connections=max_connections,
                # A failover moves slots: after a connection error the client reads the slot
                # map again and retries (6 times, at once); past that the callers retry (the
                # scripts are idempotent), until the replica is promoted.
                retry=Retry(ExponentialWithJitterBackoff(base=0.1, cap=1.0), 6),
                retry_on_error=[RedisConnectionError, RedisTimeoutError],
            )
        )
        return cls(
            main=main,
            cluster=True,
            auth=auth,
            nodes=list(cluster_nodes),
            timeout_s=timeout_s,
            max_connections=max_connections,
            wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms,
        )

    def sync_client(self, timeout_s: float | None = None) -> Any:
        """A synchronous client of the same Redis or cluster (redis.Redis or
        redis.cluster.RedisCluster, thread-safe), with connections of its own: for a
        thread that must go on while the event loop is busy. timeout_s: its socket
        timeout (default the clients' own)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        errors = [RedisConnectionError, RedisTimeoutError]
        if not self.cluster:
            return sync_redis.Redis.from_url(
                self.url,
                decode_responses=True,
                socket_timeout=timeout,
                socket_connect_timeout=min(timeout, 2.0),
                health_check_interval=30,
                retry=sync_retry.Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), 3),
                retry_on_error=errors,
            )
        return sync_cluster.RedisCluster(
            startup_nodes=[sync_cluster.ClusterNode(*_node(n)) for n in self.nodes],
            **self.auth,
            decode_responses=True,
            socket_timeout=timeout,
            socket_connect_timeout=min(timeout, 2.0),
            retry=sync_retry.Retry(ExponentialWithJitterBackoff(base=0.1, cap=1.0), 6),
            retry_on_error=errors,
        )

    # -- plain connections to cluster nodes ------------------------------------------------

    def _plain(self, host: str, port: int, *, blocking: bool) -> Redis:
        return _guard(
            Redis(
                host=host,
                port=port,
                **self.auth,
                decode_responses=True,
                socket_timeout=self.timeout_s + (MAX_BLOCK_MS / 1000 if blocking else 0),
                socket_connect_timeout=min(self.timeout_s, 2.0),
                single_connection_client=blocking,
            )
        )

    def _node_client(self, host: str, port: int) -> Redis:
        client = self._nodes.get((host, port))
        if client is None:
            auth = self.auth
            scheme = "rediss" if auth.get("ssl") else "redis"
            user = quote(auth.get("username", ""), safe="")
            login = f"{user}:{quote(auth['password'], safe='')}@" if "password" in auth else ""
            client = self._nodes[(host, port)] = connect(
                f"{scheme}://{login}{host}:{port}",
                timeout_s=self.timeout_s,
                max_connections=max(8, self.max_connections // 4),
            )
        return client

    async def refresh(self) -> None:
        """Read the cluster's slot map again (after a failover: who holds what now)."""
        if not self.cluster or time.monotonic() - self._refreshed_at < _REFRESH_EVERY_S:
            return
        self._refreshed_at = time.monotonic()
        try:
            await self.main.nodes_manager.initialize()
        except RedisError as exc:  # no node answers yet: the caller's next try asks again
            log.debug("refreshing the cluster's slot map failed: %s", exc)

    async def _owner(self, key: str) -> tuple[str, int]:
        """The primary that holds `key`'s slot, as the slot map says now."""
        await self.main.initialize()
        node = self.main.get_node_from_key(key)
        return node.host, node.port

    async def _any_node(self) -> tuple[str, int]:
        await self.main.initialize()
        node = random.choice(self.main.get_nodes())
        return node.host, node.port

    # -- durable writes --------------------------------------------------------------------

    async def replicated(self, script: AsyncScript, keys: list[str], args: list[Any]) -> tuple[Any, int | None]:
        """Run `script` on the node holding keys[0] and, with wait_replicas, WAIT on the
        same connection: (the script's reply, the replicas that confirmed its writes within
        wait_timeout_ms; None when not asked). A MOVED answer (the script did not run) is
        followed; an outage is retried until timeout_s (the scripts are idempotent).

        A retry runs on a new connection, whose WAIT counts only that connection's own
        writes: the replicated scripts (SUBMIT, FINISH) therefore write something even when
        they find their own earlier write (a replay: gateway/server/queue/scripts/
        `sync`), so a WAIT after a replay still covers the write it found."""
        if self.group is not None:
            return await self.group.call(script, keys, args, wait=True)
        if not self.wait_replicas:
            return await script(keys=keys, args=args), None
        if not self.cluster:
            return await self._script_then_wait(self.main, script, keys, args)
        deadline = time.monotonic() + self.timeout_s
        delay = 0.05
        address: tuple[str, int] | None = None
        asking = False
        redirects = 0
        while True:
            try:
                if address is None:
                    address = await self._owner(keys[0])
                client = self._node_client(*address)
                return await self._script_then_wait(client, script, keys, args, asking=asking)
            except AskError as exc:  # MovedError too: the slot is (or is being) served elsewhere
                redirects += 1
                if redirects > 16:
                    raise
                asking = not isinstance(exc, MovedError)  # a slot being migrated: ASKING first
                if not asking:
                    self.main.nodes_manager.move_slot(exc)
                address = (exc.host, exc.port)
            except REDIS_OUTAGE:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(0.5, delay * 2)
                await self.refresh()
                address = None

    async def _script_then_wait(
        self, client: Redis, script: AsyncScript, keys: list[str], args: list[Any], *, asking: bool = False
    ) -> tuple[Any, int]:
        for _ in range(2):
            async with client.pipeline(transaction=False) as pipe:
                if asking:
                    pipe.execute_command("ASKING")
                pipe.evalsha(script.sha, len(keys), *keys, *args)
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
                *_, reply, acked = await pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError):  # a node that never saw it (or restarted)
                await client.script_load(script.script)
                continue
            if isinstance(reply, Exception):
                raise reply
            if isinstance(acked, Exception):
                raise acked
            return reply, int(acked)
        raise NoScriptError("the script could not be loaded")

    # -- pub/sub and blocking readers ------------------------------------------------------

    @asynccontextmanager
    async def subscription(self, *channels: str) -> AsyncIterator[PubSub]:
        """A pub/sub connection subscribed to the channels (in a cluster, on any node:
        PUBLISH reaches every node). A node that does not answer makes the slot map be
        read again, so the caller's next try (its supervisor restarts it) goes elsewhere."""
        client = self.main
        if self.cluster:
            client = self._plain(*await self._any_node(), blocking=False)
        pubsub = client.pubsub()
        try:
            try:
                await pubsub.subscribe(*channels)
            except REDIS_OUTAGE:
                await self.refresh()
                raise
            yield pubsub
        finally:
            await pubsub.aclose()
            if client is not self.main:
                await client.aclose()

    async def reader(self, shard: Shard) -> Redis:
        """One connection to the Redis holding `shard`, for blocking reads."""
        if not self.cluster:
            return _guard(
                Redis.from_url(
                    self.url,
                    decode_responses=True,
                    socket_timeout=self.timeout_s + MAX_BLOCK_MS / 1000,
                    socket_connect_timeout=min(self.timeout_s, 2.0),
                    single_connection_client=True,
                )
            )
        try:
            # A keyed command through the cluster client first: it follows a MOVED (the
            # slot changed hands) and notices a dead node, so the map read next is current.
            await self.main.exists(shard.backlog)
        except REDIS_OUTAGE:
            await self.refresh()
            raise
        address = await self._owner(shard.backlog)
        client = self._plain(*address, blocking=True)
        try:
            self._reader_nodes.setdefault(int(await client.client_id()), set()).add(address)
            while len(self._reader_nodes) > _READER_IDS_KEPT:  # readers long gone: the oldest
                del self._reader_nodes[next(iter(self._reader_nodes))]
        except BaseException:
            await client.aclose()
            raise
        return client

    def unblocker(self) -> Any:
        """The client through which blocked readers are interrupted (CLIENT UNBLOCK <id>):
        the main one on a single Redis; in a cluster, one that sends the command to the
        node(s) where a reader of ours has that id."""
        return self.main if not self.cluster else _ClusterUnblocker(self)

    async def unblock(self, client_id: int) -> int:
        unblocked = 0
        for host, port in list(self._reader_nodes.get(client_id, ())):
            unblocked += int(await self._node_client(host, port).client_unblock(client_id))
        return unblocked

    async def aclose(self) -> None:
        for client in self._nodes.values():
            await client.aclose()
        self._nodes.clear()
        await self.main.aclose()


class _ClusterUnblocker:
    """The cluster client, but CLIENT UNBLOCK goes to the reader's own node."""

    def __init__(self, clients: RedisClients) -> None:
        self._clients = clients

    async def client_unblock(self, client_id: int, error: bool = False) -> int:
        return await self._clients.unblock(client_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._clients.main, name)


__all__ = ["MAX_BLOCK_MS", "REDIS_OUTAGE", "NotReplicated", "RedisClients", "RedisError", "connect", "credentials"]
