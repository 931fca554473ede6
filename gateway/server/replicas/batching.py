"""Embedding requests for one model on one replica share Triton calls.

A gRPC call costs the gateway about the same CPU whatever it carries (~185 µs of a
`tritonclient.grpc.aio` infer, docs/benchmarks.md), so requests of one model that are
ready together go to the replica as one ModelInfer with a batch dimension: at most
`calls` (TRITON_BATCH_CALLS) calls of a model are in flight on a replica, and what becomes
ready meanwhile waits for the next one to end, then goes in one call of up to the model's
max_batch_size (read from the model's configuration, once per replica). An idle model
costs no wait: a request that finds no call in flight is sent from its own task at once
(no task, no timer: the gRPC call's deadline is the request's), one that finds fewer than
`calls` in flight in the same turn of the event loop. Each request still holds its own
replica slot.

A many-input request (an embeddings call of a list) is rows of its own: its rows fill
calls as one-row requests do, so a request larger than max_batch_size is split into
several calls (up to `calls` of them in flight) within its one run, and its answer is all
its rows in order, once the last call holding any of them has answered.

A batched call that fails as a whole for what may be one request's input is tried again in
halves, one half after the other (so a bad input fails only its own request, found in a
few calls, and the retries never hold more calls in flight than the call they replace); one
that fails for the replica's sake (unavailable, overloaded, out of time) fails its
requests at once, to be run elsewhere. A caller that stops waiting (a cancel, its deadline)
leaves the call to the others. The model's configuration (its max_batch_size) is asked for
with a timeout of CONFIG_TIMEOUT_S; unknown, calls carry one request. Only runs whose
input is one BYTES element of shape [1] per row and whose output is one tensor (the
embedding models) are batched: see Run.batch_row.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

from gateway.server.models.base import BatchRow
from gateway.server.replicas.pool import Replica

log = logging.getLogger(__name__)

CONFIG_TIMEOUT_S = 5.0
# Statuses of a call that failed for the replica's sake, not an input's: not retried here.
_REPLICA_FAULTS = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "RESOURCE_EXHAUSTED")


def _inputs_may_be_at_fault(exc: BaseException) -> bool:
    if isinstance(exc, OSError | asyncio.TimeoutError):
        return False
    status = str(exc.status() or "") if isinstance(exc, InferenceServerException) else ""
    return not any(fault in status for fault in _REPLICA_FAULTS)


@dataclass
class _Item:
    row: BatchRow
    request_id: str
    deadline: float  # loop time
    answer: asyncio.Future[tuple[np.ndarray, np.ndarray | None]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    sent: int = 0  # rows handed to calls so far
    filled: int = 0  # rows answered so far
    out: np.ndarray | None = None  # its rows' outputs, filled in place as calls answer
    counts: np.ndarray | None = None  # and their second output's (row.count_name), if any

    @property
    def size(self) -> int:
        return len(self.row.rows)


@dataclass(frozen=True)
class _Piece:
    """Rows [start, start + count) of one request, in one call."""

    item: _Item
    start: int
    count: int

    @property
    def values(self) -> tuple[bytes, ...]:
        return self.item.row.rows[self.start : self.start + self.count]


class RowResult:
    """What a caller gets: its own rows (one per input, in order), read the way an
    InferResult is read."""

    def __init__(
        self, name: str, rows: np.ndarray, count_name: str | None = None, counts: np.ndarray | None = None
    ) -> None:
        self._found = {name: rows, **({count_name: counts} if count_name and counts is not None else {})}

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self._found.get(name)


@dataclass
class _Lane:
    """One model on one replica: its calls in flight and the rows waiting for a call."""

    in_flight: int = 0
    waiting: deque[_Item] = field(default_factory=deque)
    # A call started whose rows are not taken yet: it takes every row of this turn.
    gathering: bool = False


class BatchedInfer:
    def __init__(self, calls: int, *, shared: bool = True) -> None:
        """shared=False: each request's rows go in calls of their own (TRITON_BATCH_CALLS=0,
        where a many-input request still needs splitting by max_batch_size)."""
        self.calls = max(1, calls)
        self.shared = shared
        self._lanes: dict[tuple[Replica, str, str], _Lane] = {}
        self._max_batch: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def infer(self, replica: Replica, model: str, row: BatchRow, request_id: str, timeout_s: float) -> RowResult:
        """The rows' outputs (one per input, in order); raises what the replica's call
        raised for them."""
        loop = asyncio.get_running_loop()
        item = _Item(row, request_id, loop.time() + timeout_s)
        key = (replica, model, "" if self.shared else request_id)
        lane = self._lanes.setdefault(key, _Lane())
        size = self._max_batch.get((replica.url, model))
        if lane.in_flight == 0 and not lane.waiting and size is not None and item.size <= max(1, size):
            # Nothing in flight: sent from the caller's own task (no sender task, no timer:
            # the call's gRPC deadline is the request's); what arrives meanwhile gathers.
            item.sent = item.size
            lane.in_flight += 1
            try:
                await self._send(replica, model, [_Piece(item, 0, item.size)])
            finally:
                lane.in_flight -= 1
                self._send_next(key, lane)
            rows, counts = item.answer.result()  # or what the call raised
            return RowResult(row.output_name, rows, row.count_name, counts)
        lane.waiting.append(item)
        if lane.in_flight < self.calls and not lane.gathering:
            self._send_next(key, lane)
        try:
            rows, counts = await asyncio.wait_for(asyncio.shield(item.answer), timeout_s)
            return RowResult(row.output_name, rows, row.count_name, counts)
        except TimeoutError:
            # As Triton words it: the request's deadline, not the replica's fault (a bare
            # TimeoutError is an OSError, which reads as a replica gone).
            raise InferenceServerException("Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED") from None
        finally:
            item.answer.cancel()  # stopped waiting (or answered): the call leaves this row out

    def _send_next(self, key: tuple[Replica, str, str], lane: _Lane) -> None:
        if not lane.waiting:
            if lane.in_flight == 0:
                self._lanes.pop(key, None)
            return
        lane.in_flight += 1
        lane.gathering = True
        task = asyncio.get_running_loop().create_task(self._call(key, lane))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, key: tuple[Replica, str, str], lane: _Lane) -> None:
        replica, model, _ = key
        try:
            size = await self._batch_size(replica, model)
            lane.gathering = False
            pieces = _gather(lane.waiting, size)
            if lane.waiting and lane.in_flight < self.calls:
                self._send_next(key, lane)  # the rest of a large request: its next call now
            if pieces:
                await self._send(replica, model, pieces)
        finally:
            lane.in_flight -= 1
            self._send_next(key, lane)

    async def _send(self, replica: Replica, model: str, pieces: list[_Piece]) -> None:
        loop = asyncio.get_running_loop()
        remaining = max(0.001, max(p.item.deadline for p in pieces) - loop.time())
        first = pieces[0].item.row
        values = [value for piece in pieces for value in piece.values]
        batch = InferInput(first.input_name, [len(values), 1], "BYTES")
        # One array of the call's rows, reshaped: a list of one-element lists costs ~7× more.
        batch.set_data_from_numpy(np.array(values, dtype=np.object_).reshape(-1, 1))
        alone = len({id(p.item) for p in pieces}) == 1
        try:
            result = await replica.client.infer(
                model,
                [batch],
                outputs=[InferRequestedOutput(n) for n in (first.output_name, first.count_name) if n],
                request_id=pieces[0].item.request_id if alone else "",
                client_timeout=remaining,
                timeout=int(remaining * 1e6),
            )
            rows = result.as_numpy(first.output_name)
            counts = result.as_numpy(first.count_name) if first.count_name else None
            if rows is None or len(rows) != len(values):
                raise RuntimeError(f"{model} answered {0 if rows is None else len(rows)} rows for {len(values)}")
        except Exception as exc:
            if alone or not _inputs_may_be_at_fault(exc):
                for piece in pieces:
                    _settle(piece.item, error=exc)
                return
            log.debug("a batch of %d for %s failed (%s); trying it in halves", len(pieces), model, type(exc).__name__)
            half = len(pieces) // 2
            await self._send(replica, model, pieces[:half])
            await self._send(replica, model, pieces[half:])
            return
        at = 0
        for piece in pieces:
            _fill(piece, rows[at : at + piece.count], None if counts is None else counts[at : at + piece.count])
            at += piece.count

    async def _batch_size(self, replica: Replica, model: str) -> int:
        key = (replica.url, model)
        size = self._max_batch.get(key)
        if size is None:
            try:
                config: dict[str, Any] = await asyncio.wait_for(
                    replica.client.get_model_config(model, as_json=True, client_timeout=CONFIG_TIMEOUT_S),
                    CONFIG_TIMEOUT_S,
                )
                size = int(config.get("config", {}).get("max_batch_size", 0))
            except Exception:  # unknown for now: one at a time, and ask again next time
                return 1
            self._max_batch[key] = size
        return max(1, size)


def _gather(waiting: deque[_Item], size: int) -> list[_Piece]:
    """Up to `size` rows for one call, from the requests first in line: a request whose
    rows do not all fit stays first, its next rows for the next call."""
    pieces: list[_Piece] = []
    room = size
    while waiting and room:
        item = waiting[0]
        if item.answer.done():  # its caller stopped waiting
            waiting.popleft()
            continue
        count = min(room, item.size - item.sent)
        pieces.append(_Piece(item, item.sent, count))
        item.sent += count
        room -= count
        if item.sent == item.size:
            waiting.popleft()
    return pieces


def _fill(piece: _Piece, rows: np.ndarray, counts: np.ndarray | None) -> None:
    item = piece.item
    if item.answer.done():
        return
    if item.size == 1:
        _settle(item, row=rows, counts=counts)  # shape [1, ...]: the one row, as a call of its own answers it
        return
    if item.out is None:
        item.out = np.empty((item.size, *rows.shape[1:]), dtype=rows.dtype)
    item.out[piece.start : piece.start + piece.count] = rows
    if counts is not None:
        if item.counts is None:
            item.counts = np.empty((item.size, *counts.shape[1:]), dtype=counts.dtype)
        item.counts[piece.start : piece.start + piece.count] = counts
    item.filled += piece.count
    if item.filled == item.size:
        _settle(item, row=item.out, counts=item.counts)


def _settle(
    item: _Item, *, row: np.ndarray | None = None, counts: np.ndarray | None = None, error: BaseException | None = None
) -> None:
    if item.answer.done():
        return
    if error is not None:
        item.answer.set_exception(error)
    else:
        item.answer.set_result((row, counts))  # type: ignore[arg-type]
