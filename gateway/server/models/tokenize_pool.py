"""Long inputs' validation (tokenization, a chat template, an image's base64 and header) in
threads of their own: a bounded pool, not the loop's default executor, which TAKE's and
the sweeper's parses and other work share. The pool holds TOKENIZE_THREADS threads and
at most TOKENIZE_QUEUE jobs waiting for one; one tenant holds at most its share of the
two together (TENANT_TOKENIZE_SHARE of them, at least one: 429 tenant_share_exceeded
beyond, gateway.server.tenants.shares), and a pool held whole refuses with 503
tokenizer_busy; both with Retry-After. The waiting jobs start by tenant in turn, so one
tenant's many long prompts wait behind each other, not in front of another tenant's.
Inputs of LONG_INPUT_CHARS characters or fewer are validated at once on the loop, as the
hand-off would cost more than the work."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from gateway.server.models.base import LONG_INPUT_CHARS, text_chars
from gateway.server.tenants.shares import SharedPool, share_of

T = TypeVar("T")

THREAD_NAME_PREFIX = "tokenize"


@dataclass(eq=False)
class _Job:
    tenant: str | None
    work: Callable[[], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[Any]
    started: bool = False


class TokenizePool:
    """The process's threads for long validations, and each tenant's share of them."""

    def __init__(self, threads: int, queue: int, tenant_share: float) -> None:
        self.threads = threads
        total = threads + queue
        self.places = SharedPool(
            "long tokenizations", total=total, share=share_of(total, tenant_share, 1), full_code="tokenizer_busy"
        )
        self.running = 0
        # Jobs waiting for a thread, by tenant, the tenant to start next first.
        self.waiting: OrderedDict[str | None, deque[_Job]] = OrderedDict()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        # Made at the first long input (in the serving process, never before a fork).
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix=THREAD_NAME_PREFIX)
        return self._executor

    async def run(self, tenant: str | None, work: Callable[[], T], *, refuse: bool = True) -> T:
        """work() in one of the pool's threads, once the tenant's turn comes. Refused at once
        (ShareExceeded, PoolFull) when the tenant holds its share or the pool is held whole;
        refuse=False: never refused (counted all the same). The place is held until the work
        ends, even when the caller stops waiting for it (a thread cannot be stopped)."""
        self.places.take(tenant, refuse=refuse)
        loop = asyncio.get_running_loop()
        # Run in the caller's context (its trace span), as asyncio.to_thread does.
        job = _Job(tenant, functools.partial(contextvars.copy_context().run, work), loop, loop.create_future())
        self.waiting.setdefault(tenant, deque()).append(job)
        job.done.add_done_callback(lambda _: self._given_up(job))
        self._start_next()
        result: T = await job.done
        return result

    def _start_next(self) -> None:
        while self.running < self.threads and self.waiting:
            tenant, jobs = next(iter(self.waiting.items()))
            job = jobs.popleft()
            if jobs:
                self.waiting.move_to_end(tenant)  # its next job after the other tenants' next
            else:
                del self.waiting[tenant]
            job.started = True
            self.running += 1
            try:
                ending = self.executor.submit(job.work)
            except RuntimeError as exc:  # the interpreter is shutting down
                self.running -= 1
                self.places.release(job.tenant)
                if not job.done.done():
                    job.done.set_exception(exc)
                continue
            ending.add_done_callback(functools.partial(self._ended_in_thread, job))

    def _ended_in_thread(self, job: _Job, ended: concurrent.futures.Future[Any]) -> None:
        try:
            job.loop.call_soon_threadsafe(self._ended, job, ended)
        except RuntimeError:  # the loop is closed: nothing waits for it any more
            pass

    def _ended(self, job: _Job, ended: concurrent.futures.Future[Any]) -> None:
        self.running -= 1
        self.places.release(job.tenant)
        if not job.done.done():
            error = ended.exception()
            if error is not None:
                job.done.set_exception(error)
            else:
                job.done.set_result(ended.result())
        self._start_next()

    def _given_up(self, job: _Job) -> None:
        """The caller stopped waiting: a job not started yet leaves the queue and its place."""
        if not job.done.cancelled() or job.started:
            return
        jobs = self.waiting.get(job.tenant)
        if jobs is not None and job in jobs:
            jobs.remove(job)
            if not jobs:
                del self.waiting[job.tenant]
            self.places.release(job.tenant)


_sizes = (2, 32, 0.25)  # TOKENIZE_THREADS, TOKENIZE_QUEUE, TENANT_TOKENIZE_SHARE
_pool: TokenizePool | None = None


def limit_tokenizing(threads: int, queue: int, tenant_share: float) -> None:
    """The process's pool sizes (the app sets them from its settings before serving)."""
    global _sizes, _pool
    _sizes, _pool = (threads, queue, tenant_share), None


def tokenize_pool() -> TokenizePool:
    global _pool
    if _pool is None:
        _pool = TokenizePool(*_sizes)
    return _pool


async def off_the_loop_if_long(inputs: Any, work: Callable[[], T], *, tenant: str | None, refuse: bool = True) -> T:
    """work(), in the tokenize pool's threads when the inputs hold over LONG_INPUT_CHARS
    characters of text (the tokenizer lets go of the interpreter's lock: gateway.server.
    llm.tokenizer.token_ids), else at once. tenant: whose share it is held in (None: the
    pool's total only). refuse=False: for work that must not be refused: a request already
    accepted (a run validating what another process queued), a batch's line (paced by the
    batch window, a few at once a process); it waits for its turn instead."""
    if text_chars(inputs) > LONG_INPUT_CHARS:
        return await tokenize_pool().run(tenant, work, refuse=refuse)
    return work()
