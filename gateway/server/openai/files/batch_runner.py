"""Drives batches to their end, in whichever gateway holds a batch's lease.

Every gateway runs one BatchRunner. It claims an active batch whose lease has run out
(find_one_and_update: one claimant wins), the oldest of the tenant served least recently
(round robin between tenants), drives it for a turn of BATCH_TURN_S and hands it back to
be claimed again, so one tenant's many batches never hold every runner while another
tenant's wait. It renews the lease while it works, and fences
every write to the batch document by its own name, so a gateway that lost the lease
(paused, partitioned) cannot overwrite the new holder's progress. A gateway that dies
simply stops renewing; another (or the same, restarted) takes the batch over.

Each valid line becomes ordinary durable requests in the `batch` band, submitted with
the idempotency key batch:<batch>:<line>:<n>, so a line submitted again after a
takeover is the same request, never a second one. At most BATCH_WINDOW lines are
submitted and unfinished at once; the rest wait in MongoDB.

A batch that ends sends its tenant's OpenAI webhook endpoint the OpenAI-style event of how
it ended (batch.completed, batch.failed, batch.cancelled, batch.expired), through the
binder's webhook queue (gateway/common/webhooks.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import tempfile
import time
from typing import Any

from pydantic import ValidationError
from pymongo import ReturnDocument, UpdateOne

from gateway.common.webhooks import enqueue_openai_event
from gateway.protocol import ResultRecord
from gateway.protocol.http import InferRequest
from gateway.server import spine
from gateway.server.api.errors import ApiError
from gateway.server.calls.requests import tokens_per_block, tool_format
from gateway.server.calls.run import raise_for_record
from gateway.server.errors import Busy, Refused
from gateway.server.openai.chat import chat_completion, chat_request, completion_request, text_completion
from gateway.server.openai.embeddings import embedding_adapter, embedding_requests, embeddings_response
from gateway.server.openai.errors import error_status, openai_error_body
from gateway.server.openai.files.batch_store import (
    ACTIVE,
    FAILED,
    PENDING,
    SKIPPED,
    SUBMITTED,
    SUCCEEDED,
    BatchStore,
)
from gateway.server.openai.files.store import OUTPUT_PURPOSE, LongLine
from gateway.server.openai.schemas import BatchLine, ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from gateway.server.services import Services
from gateway.server.tenants.caller import Caller

log = logging.getLogger(__name__)

# Submission refusals that mean "not now" (the line is tried again), not "never".
_LATER = {"backlog_full", "rate_limited", "token_rate_limited", "redis_unavailable", "redis_full", "mongo_unavailable"}
_RENEW_EVERY_LINES = 500
# Validation writes its line documents in bulks of at most this much input (and of at most
# _RENEW_EVERY_LINES lines): what it holds of a large file is one bulk.
_WRITE_BYTES = 512 << 10


# How a runner's drive of a batch ends: the batch ended, or its turn did.
ENDED, TURN_OVER = "ended", "turn_over"


class LeaseLost(Exception):
    pass


def _parse(endpoint: str, body: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest | EmbeddingRequest:
    if endpoint == "/v1/chat/completions":
        return ChatCompletionRequest.model_validate(body)
    if endpoint == "/v1/completions":
        return CompletionRequest.model_validate(body)
    return EmbeddingRequest.model_validate(body)


def native_requests(
    endpoint: str, body: dict[str, Any], svc: Services, labels: dict[str, str] | None = None
) -> list[InferRequest]:
    """The ordinary requests behind one line (raises ApiError or ValidationError); labels
    go into their records' metadata."""
    parsed = _parse(endpoint, body)
    # Several choices without a seed get seeds derived from the line, so a line submitted
    # again is the same requests.
    seed_key = f"{labels.get('batch_id')}:{labels.get('custom_id')}" if labels else None
    if isinstance(parsed, ChatCompletionRequest):
        natives = chat_request(parsed, svc, seed_key)
    elif isinstance(parsed, CompletionRequest):
        natives = completion_request(parsed, svc, seed_key)
    else:
        natives = embedding_requests(parsed, svc)
    timeout_s = svc.settings.max_timeout_s
    return [
        n.model_copy(update={"stream": False, "timeout_s": timeout_s, "metadata": {**n.metadata, **(labels or {})}})
        for n in natives
    ]


def line_response(endpoint: str, body: dict[str, Any], records: list[ResultRecord], svc: Services) -> tuple[int, dict]:
    """The HTTP status and body the line's call would have answered."""
    parsed = _parse(endpoint, body)
    try:
        if isinstance(parsed, EmbeddingRequest):
            return 200, embeddings_response(records, embedding_adapter(svc, parsed), parsed)
        for record in records:
            raise_for_record(record)
        tpb = tokens_per_block(svc, parsed.model)
        if isinstance(parsed, ChatCompletionRequest):
            return 200, chat_completion(records, parsed, tpb, tool_format(svc, parsed.model))
        return 200, text_completion(records, parsed, tpb)
    except ApiError as exc:
        return error_status(exc.status), openai_error_body(exc.status, exc.code, exc.message, exc.details)


def _invalid(exc: ApiError | ValidationError | ValueError) -> dict[str, Any]:
    if isinstance(exc, ApiError):
        return {"code": exc.code, "message": exc.message}
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return {"code": "invalid_request", "message": f"{where}: {first.get('msg', 'invalid')}"[:500]}
    return {"code": "invalid_json", "message": str(exc)[:500]}


class BatchRunner:
    def __init__(self, svc: Services, store: BatchStore) -> None:
        self.svc = svc
        self.store = store
        self.settings = svc.settings
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.wake = asyncio.Event()
        self.driving: dict[str, asyncio.Task[None]] = {}

    def notice(self) -> None:
        """A batch was created or cancelled here: look now, not at the next poll."""
        self.wake.set()

    async def run(self) -> None:
        """Claim batches whose lease ran out and drive them (supervised: returns only by failing)."""
        while True:
            while len(self.driving) < self.settings.batch_concurrency:
                batch = await self._claim()
                if batch is None:
                    break
                self._start(batch["_id"])
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), self.settings.batch_poll_s * 2)
            except TimeoutError:
                pass

    def _start(self, batch_id: str) -> None:
        task = asyncio.create_task(self._drive_logged(batch_id), name=f"batch {batch_id}")
        self.driving[batch_id] = task
        task.add_done_callback(lambda _: self.driving.pop(batch_id, None))

    async def close(self) -> None:
        """Stop driving; the leases run out and another gateway takes the batches over."""
        for task in list(self.driving.values()):
            task.cancel()
        await asyncio.gather(*self.driving.values(), return_exceptions=True)

    async def _claim(self) -> dict[str, Any] | None:
        """The oldest claimable batch of the tenant whose batches were claimed least
        recently (round robin between tenants, across every runner: `batch_turns` keeps
        when each tenant was last served), so a tenant with many batches gets one turn
        while others wait, not every runner."""
        await self.store.prepare()
        now = time.time()
        claimable = {"status": {"$in": list(ACTIVE)}, "lease_until": {"$lt": now}, "_id": {"$nin": list(self.driving)}}
        tenants = await self.store.batches.distinct("tenant", claimable)
        if not tenants:
            return None
        served = {d["_id"]: float(d.get("at") or 0.0) async for d in self.store.turns.find({"_id": {"$in": tenants}})}
        for tenant in sorted(tenants, key=lambda t: (served.get(t, 0.0), t)):
            batch = await self.store.batches.find_one_and_update(
                {**claimable, "tenant": tenant},
                {"$set": {"lease_owner": self.name, "lease_until": now + self.settings.batch_lease_s}},
                sort=[("created_at", 1)],  # its oldest first
                return_document=ReturnDocument.AFTER,
            )
            if batch is not None:
                await self.store.turns.update_one({"_id": tenant}, {"$set": {"at": time.time()}}, upsert=True)
                return batch
        return None

    async def _drive_logged(self, batch_id: str) -> None:
        try:
            if await self.drive(batch_id) == TURN_OVER:
                # Handed back: claim again now (this slot may go to another tenant's batch).
                self.driving.pop(batch_id, None)
                self.wake.set()
        except LeaseLost:
            log.info("batch %s: lease lost to another gateway", batch_id)
        except asyncio.CancelledError:
            raise
        except Exception:  # MongoDB or Redis away: the lease runs out and the batch is taken up again
            log.exception("batch %s: stopped; it is taken up again when its lease runs out", batch_id)

    # -- one batch ------------------------------------------------------------------------

    async def _update(
        self, batch_id: str, fields: dict[str, Any], expect: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """Set fields (and renew the lease) only while this gateway holds the lease, and
        only if the batch matches expect (None when it does not: a cancel came first)."""
        fields = {"lease_until": time.time() + self.settings.batch_lease_s, **fields}
        held = {"_id": batch_id, "lease_owner": self.name}
        document = await self.store.batches.find_one_and_update(
            {**held, **(expect or {})}, {"$set": fields}, return_document=ReturnDocument.AFTER
        )
        if document is None and (not expect or await self.store.batches.find_one(held) is None):
            raise LeaseLost(batch_id)
        return document

    async def _renew(self, batch_id: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
        document = await self._update(batch_id, fields or {})
        assert document is not None
        return document

    async def drive(self, batch_id: str) -> str:
        """Drive the batch to its end (ENDED), or for one turn of BATCH_TURN_S while it is
        in progress, then hand it back (TURN_OVER): its lease is released for the next
        claim, which serves the tenant that waited longest. Validation is never cut short
        (it starts again from its first line)."""
        batch = await self._renew(batch_id)
        turn_ends = time.monotonic() + self.settings.batch_turn_s
        while True:
            status = batch["status"]
            if status == "validating":
                batch = await self.validate(batch)
            elif status in ("in_progress", "cancelling"):
                if await self.advance(batch):
                    batch = await self._renew(batch_id, {"status": "finalizing", "finalizing_at": int(time.time())})
                elif status == "in_progress" and time.monotonic() >= turn_ends:
                    await self._renew(batch_id, {"lease_owner": "", "lease_until": 0.0})
                    return TURN_OVER
                else:
                    await asyncio.sleep(self.settings.batch_poll_s)
                    batch = await self._renew(batch_id)
            elif status == "finalizing":
                await self.finalize(batch)
                return ENDED
            else:
                return ENDED

    async def _fail(self, batch: dict[str, Any], code: str, message: str) -> dict[str, Any]:
        error = {"code": code, "message": message, "param": "input_file_id", "line": None}
        errors = {"object": "list", "data": [error]}
        failed = await self._renew(
            batch["_id"], {"status": "failed", "failed_at": int(time.time()), "errors": errors, "lease_until": 0.0}
        )
        await self._announce(batch, "failed")
        return failed

    async def _announce(self, batch: dict[str, Any], ending: str) -> None:
        """The batch's OpenAI webhook event (best effort: the batch has ended either way)."""
        try:
            await enqueue_openai_event(
                self.svc.redis, batch["tenant"], f"batch.{ending}", batch["_id"], shards=self.settings.redis_shards
            )
        except Exception as exc:
            log.warning("batch %s: queueing its batch.%s webhook failed: %s", batch["_id"], ending, exc)

    async def validate(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Read the input file into line documents (invalid lines end at once, failed),
        line by line as it streams from GridFS: a large file is never held whole. A file
        that fails as a whole (not UTF-8, too many lines) takes the lines written back."""
        # Counted before it starts: a validation that kills its runner (or never ends
        # inside its lease) is not started again for ever.
        batch = await self._renew(batch["_id"], {"validations": int(batch.get("validations") or 0) + 1})
        if batch["validations"] > self.settings.batch_max_validations:
            await self.store.lines.delete_many({"batch": batch["_id"]})
            return await self._fail(
                batch,
                "validation_failed",
                f"validating the input file did not end in {self.settings.batch_max_validations} attempts",
            )
        # A line past the limit is counted, never joined nor decoded (a LongLine).
        limit = self.settings.batch_max_line_bytes
        lines = await self.svc.files.lines(batch["tenant"], batch["input_file_id"], most=limit)
        if lines is None:
            return await self._fail(batch, "file_not_found", f"no file {batch['input_file_id']}")
        max_lines, room = self.settings.batch_max_lines, await self._lines_room(batch)
        seen: set[str] = set()
        writes: list[UpdateOne] = []
        count = n = buffered = 0
        async for data in lines:
            n += 1
            raw = ""
            if not isinstance(data, LongLine):
                try:
                    raw = data.decode("utf-8")
                except UnicodeDecodeError:
                    await self.store.lines.delete_many({"batch": batch["_id"]})
                    return await self._fail(batch, "invalid_file", "the input file is not UTF-8 text")
                if not raw.strip():
                    continue
            count += 1
            if count > max_lines:
                await self.store.lines.delete_many({"batch": batch["_id"]})
                return await self._fail(batch, "too_many_lines", f"a batch may have at most {max_lines} lines")
            if room is not None and count > room:
                await self.store.lines.delete_many({"batch": batch["_id"]})
                return await self._fail(
                    batch,
                    "batch_lines_quota_exceeded",
                    f"the tenant's batches not ended may hold {self.settings.tenant_max_batch_lines} lines together "
                    f"(TENANT_MAX_BATCH_LINES); the others hold {self.settings.tenant_max_batch_lines - room}",
                )
            line: dict[str, Any] = {"batch": batch["_id"], "line": n, "custom_id": None, "outcome": PENDING}
            if isinstance(data, LongLine):
                # Never stored (a document holds at most 16 MiB): a failed line of its own.
                line |= {"outcome": FAILED, "error": _too_large(data.size, limit)}
                writes.append(UpdateOne({"_id": f"{batch['_id']}:{n:07d}"}, {"$set": line}, upsert=True))
                continue
            try:
                parsed = BatchLine.model_validate(await _json_line_off_the_loop(raw))
                line["custom_id"] = parsed.custom_id
                if parsed.url != batch["endpoint"]:
                    raise ApiError(400, "invalid_url", f"url must be the batch's endpoint {batch['endpoint']}")
                if parsed.custom_id in seen:
                    raise ApiError(400, "duplicate_custom_id", f"custom_id {parsed.custom_id!r} is used twice")
                seen.add(parsed.custom_id)
                native_requests(batch["endpoint"], parsed.body, self.svc)  # refuses what would be refused
                line["body"] = parsed.body
            except (ApiError, ValidationError, ValueError) as exc:
                line |= {"outcome": FAILED, "error": _invalid(exc)}
                if line["custom_id"] is None and isinstance(exc, ValidationError):
                    line["custom_id"] = _custom_id_of(raw)
            writes.append(UpdateOne({"_id": f"{batch['_id']}:{n:07d}"}, {"$set": line}, upsert=True))
            buffered += len(data)
            if buffered >= _WRITE_BYTES or count % _RENEW_EVERY_LINES == 0:
                await self.store.lines.bulk_write(writes, ordered=False)
                writes, buffered = [], 0
            if count % _RENEW_EVERY_LINES == 0:
                await self._renew(batch["_id"])
        if writes:
            await self.store.lines.bulk_write(writes, ordered=False)
        if not count:
            return await self._fail(batch, "empty_file", "the input file has no lines")
        fields = {"in_progress_at": int(time.time()), "request_counts": await self._counts(batch["_id"])}
        started = await self._update(batch["_id"], {**fields, "status": "in_progress"}, {"status": "validating"})
        return started or await self._renew(batch["_id"], fields)  # cancelled while validating: stays cancelling

    async def _lines_room(self, batch: dict[str, Any]) -> int | None:
        """How many lines this batch may have within TENANT_MAX_BATCH_LINES: the limit less
        the lines of the tenant's other batches not ended (those validated; None: no limit)."""
        limit = self.settings.tenant_max_batch_lines
        if not limit:
            return None
        others = self.store.batches.find(
            {"status": {"$in": list(ACTIVE)}, "tenant": batch["tenant"], "_id": {"$ne": batch["_id"]}},
            {"request_counts": 1},
        )
        held = sum([int((d.get("request_counts") or {}).get("total") or 0) async for d in others])
        return max(0, limit - held)

    async def advance(self, batch: dict[str, Any]) -> bool:
        """One round: collect ended lines, submit more (or cancel); True when nothing is left."""
        batch_id = batch["_id"]
        outstanding = [d async for d in self.store.lines.find({"batch": batch_id, "outcome": SUBMITTED})]
        outstanding = await self._collect(batch, outstanding)
        # `batch` is what the lease renewal just returned: a cancel since then is seen next round.
        stopping = batch["status"] == "cancelling"
        expired = time.time() >= batch["expires_at"]
        if stopping or expired:
            for line in outstanding:
                for request_id in line["request_ids"]:
                    await spine.cancel(self.svc.jobs, request_id)
            ending = "cancelled" if stopping else "expired"
            outcome: dict[str, Any] = {"outcome": SKIPPED}
            if expired and not stopping:
                outcome = {"outcome": FAILED, "error": {"code": "batch_expired", "message": "the batch expired first"}}
            await self.store.lines.update_many({"batch": batch_id, "outcome": PENDING}, {"$set": outcome})
            await self._renew(batch_id, {"ending": ending, "request_counts": await self._counts(batch_id)})
            return not outstanding
        room = self.settings.batch_window - len(outstanding)
        if room > 0:
            await self._submit(batch, room)
        counts = await self._counts(batch_id)
        await self._renew(batch_id, {"request_counts": counts})
        left = await self.store.lines.count_documents({"batch": batch_id, "outcome": {"$in": [PENDING, SUBMITTED]}})
        return left == 0

    async def _collect(self, batch: dict[str, Any], outstanding: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """End the lines whose requests have all ended; the lines still running."""
        ids = [rid for line in outstanding for rid in line["request_ids"]]
        records = await self.svc.results.get_many(ids, batch["tenant"]) if ids else {}
        running = []
        for line in outstanding:
            found = [records.get(rid) for rid in line["request_ids"]]
            ended = [r for r in found if r is not None and r.status.terminal]
            if len(ended) < len(found):
                running.append(line)
                continue
            status_code, body = line_response(batch["endpoint"], line["body"], ended, self.svc)
            await self.store.lines.update_one(
                {"_id": line["_id"]},
                {
                    "$set": {
                        "outcome": SUCCEEDED if status_code == 200 else FAILED,
                        "response": {"status_code": status_code, "request_id": line["request_ids"][0], "body": body},
                    }
                },
            )
        return running

    async def _submit(self, batch: dict[str, Any], room: int) -> None:
        who = Caller(tenant=batch["tenant"], role="user", config=await self.svc.tenants.get(batch["tenant"]))
        pending = self.store.lines.find({"batch": batch["_id"], "outcome": PENDING}).sort("line", 1).limit(room)
        async for line in pending:
            try:
                labels = {"batch_id": batch["_id"], "custom_id": str(line["custom_id"])[:512]}
                natives = native_requests(batch["endpoint"], line["body"], self.svc, labels)
                # All of a line's requests at once, with keys: a line submitted again (after a
                # takeover, or a lost reply) is the same requests, never new ones.
                keys = [f"batch:{batch['_id']}:{line['line']}:{n}" for n in range(len(natives))]
                submitted = await self.svc.submitter.submit_many(who, natives, idempotency_keys=keys, batch=True)
                ids = submitted.request_ids
            except Busy:
                return  # full: the next round tries again
            except Refused as exc:
                await self.store.lines.update_one(
                    {"_id": line["_id"]}, {"$set": {"outcome": FAILED, "error": _invalid_refusal(exc)}}
                )
                continue
            except ApiError as exc:
                if exc.code in _LATER or exc.status in (429, 503):
                    return  # full or away: the next round tries again
                await self.store.lines.update_one(
                    {"_id": line["_id"]}, {"$set": {"outcome": FAILED, "error": _invalid(exc)}}
                )
                continue
            except (ValidationError, ValueError) as exc:
                await self.store.lines.update_one(
                    {"_id": line["_id"]}, {"$set": {"outcome": FAILED, "error": _invalid(exc)}}
                )
                continue
            await self.store.lines.update_one(
                {"_id": line["_id"]}, {"$set": {"outcome": SUBMITTED, "request_ids": ids}}
            )

    async def _counts(self, batch_id: str) -> dict[str, int]:
        lines = self.store.lines
        return {
            # Every line of the batch, whether or not it ran (a cancelled batch keeps its total).
            "total": await lines.count_documents({"batch": batch_id}),
            "completed": await lines.count_documents({"batch": batch_id, "outcome": SUCCEEDED}),
            "failed": await lines.count_documents({"batch": batch_id, "outcome": FAILED}),
        }

    async def finalize(self, batch: dict[str, Any]) -> None:
        """Write the output and error files, then end the batch."""
        batch_id, tenant = batch["_id"], batch["tenant"]
        ulid = batch_id.removeprefix("batch_")
        with tempfile.SpooledTemporaryFile(8 << 20) as output, tempfile.SpooledTemporaryFile(8 << 20) as errors:
            written = {"output": 0, "errors": 0}
            async for line in self.store.lines.find({"batch": batch_id}).sort("line", 1):
                if line["outcome"] == SKIPPED:
                    continue
                entry = {
                    "id": f"batch_req_{ulid}_{line['line']}",
                    "custom_id": line.get("custom_id"),
                    "response": line.get("response"),
                    "error": line.get("error"),
                }
                target = "output" if line["outcome"] == SUCCEEDED else "errors"
                (output if target == "output" else errors).write(json.dumps(entry, ensure_ascii=False).encode() + b"\n")
                written[target] += 1
            files: dict[str, Any] = {"output_file_id": None, "error_file_id": None}
            for target, handle, field in (("output", output, "output_file_id"), ("errors", errors, "error_file_id")):
                if written[target]:
                    handle.seek(0)
                    name = f"{batch_id}_{target}.jsonl"
                    stored = await self.svc.files.put(tenant, name, OUTPUT_PURPOSE, handle, f"file-{ulid}-{target}")
                    files[field] = stored["id"]
        ending = batch.get("ending") or "completed"
        now = int(time.time())
        counts = await self._counts(batch_id)
        await self._renew(
            batch_id,
            {**files, "status": ending, f"{ending}_at": now, "request_counts": counts, "lease_until": 0.0},
        )
        await self.store.lines.delete_many({"batch": batch_id})
        log.info("batch %s %s: %s", batch_id, ending, counts)
        await self._announce(batch, ending)


def _invalid_refusal(exc: Refused) -> dict[str, Any]:
    return {"code": exc.code, "message": exc.message}


# A line longer than this is parsed in a worker thread: the event loop serves on meanwhile.
_PARSE_OFF_THE_LOOP = 64 << 10


def _too_large(size: int, limit: int) -> dict[str, Any]:
    return {
        "code": "line_too_large",
        "message": f"the line has {size} bytes; a line may have at most {limit} (BATCH_MAX_LINE_BYTES)",
    }


async def _json_line_off_the_loop(raw: str) -> Any:
    if len(raw) > _PARSE_OFF_THE_LOOP:
        return await asyncio.to_thread(_json_line, raw)
    return _json_line(raw)


def _json_line(raw: str) -> Any:
    """A line's JSON; one nested too deeply to parse is invalid JSON like any other."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("the line's JSON is nested too deeply") from None


def _custom_id_of(raw: str) -> str | None:
    try:
        found = _json_line(raw).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None
