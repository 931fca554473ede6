"""Embedding requests for one model on one replica share Triton calls.

A gRPC call costs the gateway about the same CPU whatever it carries (~185 µs of a
`tritonclient.grpc.aio` infer, docs/benchmarks.md), so requests of one model that are
ready together go to the replica as one ModelInfer with a batch dimension: at most
`calls` (TRITON_BATCH_CALLS) calls of a model are in flight on a replica, and what becomes
ready meanwhile waits for the next one to end, then goes in one call of up to the model's
max_batch_size (read from the model's configuration, once per replica). An idle model
costs no wait: a request that finds fewer calls in flight is sent in the same turn of the
event loop. Each request still holds its own replica slot.

A batched call that fails as a whole is tried again item by item, so one bad input fails
only itself; a caller that stops waiting (a cancel, its deadline) leaves the call to the
others. Only runs whose input is one BYTES element of shape [1] and whose output is one
tensor (the embedding models) are batched: see Run.batch_row.
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


@dataclass
class _Item:
    row: BatchRow
    request_id: str
    deadline: float  # loop time
    answer: asyncio.Future[np.ndarray] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class RowResult:
    """What a caller gets: its own row, read the way an InferResult is read."""

    def __init__(self, name: str, row: np.ndarray) -> None:
        self._name, self._row = name, row

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self._row[np.newaxis, ...] if name == self._name else None


@dataclass
class _Lane:
    """One model on one replica: its calls in flight and the rows waiting for a call."""

    in_flight: int = 0
    waiting: deque[_Item] = field(default_factory=deque)
    # A call started whose rows are not taken yet: it takes every row of this turn.
    gathering: bool = False


class BatchedInfer:
    def __init__(self, calls: int) -> None:
        self.calls = max(1, calls)
        self._lanes: dict[tuple[Replica, str], _Lane] = {}
        self._max_batch: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def infer(self, replica: Replica, model: str, row: BatchRow, request_id: str, timeout_s: float) -> RowResult:
        """The row's output; raises what the replica's call raised for it."""
        loop = asyncio.get_running_loop()
        item = _Item(row, request_id, loop.time() + timeout_s)
        lane = self._lanes.setdefault((replica, model), _Lane())
        lane.waiting.append(item)
        if lane.in_flight < self.calls and not lane.gathering:
            self._send_next(replica, model, lane)
        try:
            return RowResult(row.output_name, await asyncio.wait_for(asyncio.shield(item.answer), timeout_s))
        except TimeoutError:
            # As Triton words it: the request's deadline, not the replica's fault (a bare
            # TimeoutError is an OSError, which reads as a replica gone).
            raise InferenceServerException("Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED") from None
        finally:
            item.answer.cancel()  # stopped waiting (or answered): the call leaves this row out

    def _send_next(self, replica: Replica, model: str, lane: _Lane) -> None:
        if not lane.waiting:
            if lane.in_flight == 0:
                self._lanes.pop((replica, model), None)
            return
        lane.in_flight += 1
        lane.gathering = True
        task = asyncio.get_running_loop().create_task(self._call(replica, model, lane))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, replica: Replica, model: str, lane: _Lane) -> None:
        try:
            size = await self._batch_size(replica, model)
            lane.gathering = False
            items = [lane.waiting.popleft() for _ in range(min(size, len(lane.waiting)))]
            items = [i for i in items if not i.answer.done()]  # callers that stopped waiting
            if items:
                await self._send(replica, model, items)
        finally:
            lane.in_flight -= 1
            self._send_next(replica, model, lane)

    async def _send(self, replica: Replica, model: str, items: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        remaining = max(0.001, max(i.deadline for i in items) - loop.time())
        first = items[0].row
        batch = InferInput(first.input_name, [len(items), 1], "BYTES")
        batch.set_data_from_numpy(np.array([[i.row.value] for i in items], dtype=np.object_))
        try:
            result = await replica.client.infer(
                model,
                [batch],
                outputs=[InferRequestedOutput(first.output_name)],
                request_id=items[0].request_id if len(items) == 1 else "",
                client_timeout=remaining,
                timeout=int(remaining * 1e6),
            )
            rows = result.as_numpy(first.output_name)
            if rows is None or len(rows) != len(items):
                raise RuntimeError(f"{model} answered {0 if rows is None else len(rows)} rows for {len(items)}")
        except Exception as exc:
            if len(items) == 1:
                _settle(items[0], error=exc)
                return
            log.debug("a batch of %d for %s failed (%s); trying each alone", len(items), model, type(exc).__name__)
            await asyncio.gather(*(self._send(replica, model, [item]) for item in items))
            return
        for item, row in zip(items, rows, strict=True):
            _settle(item, row=row)

    async def _batch_size(self, replica: Replica, model: str) -> int:
        key = (replica.url, model)
        size = self._max_batch.get(key)
        if size is None:
            try:
                config: dict[str, Any] = await replica.client.get_model_config(model, as_json=True)
                size = int(config.get("config", {}).get("max_batch_size", 0))
            except Exception:  # unknown for now: one at a time, and ask again next time
                return 1
            self._max_batch[key] = size
        return max(1, size)


def _settle(item: _Item, *, row: np.ndarray | None = None, error: BaseException | None = None) -> None:
    if item.answer.done():
        return
    if error is not None:
        item.answer.set_exception(error)
    else:
        item.answer.set_result(row)  # type: ignore[arg-type]
