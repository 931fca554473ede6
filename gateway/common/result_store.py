"""Results in MongoDB: one document per request, keyed by request_id (the unique _id),
kept until expires_at (TTL index). The binder writes; the gateway reads.

A duplicate-key error on insert means "already stored", which makes every write
idempotent however often a result is delivered. Embeddings are stored as BSON float32
vectors (binary subtype 9): a quarter of the size of an array of doubles, and far
cheaper to write.

A document MongoDB can never take (BSON cannot encode it: an integer over 64 bits, a
string that is not UTF-8; or it is over the server's document size limit; or MongoDB
refused that document itself) is refused alone: the others of its batch are stored, and
the caller dead-letters it instead of retrying it for ever, storing in its place the
request's record as failed (`result_unstorable`, `unstorable_record`). An error that is not
a document's (the server stepping down, a timeout, out of reach) is an outage: nothing of
the batch counts as stored or refused, and the caller retries it."""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import bson
from bson.binary import Binary, BinaryVectorDtype
from bson.raw_bson import RawBSONDocument
from pymongo import AsyncMongoClient, WriteConcern
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError, PyMongoError

from gateway.protocol import ErrorInfo, ResultRecord, State
from gateway.protocol.vectors import is_packed, packed_bytes

log = logging.getLogger(__name__)

RESULTS_COLLECTION = "results"
DUPLICATE_KEY = 11000
VECTOR_SUBTYPE = 9
# MongoDB's document size limit, unless the server says another (hello's maxBsonObjectSize).
MAX_DOCUMENT_BYTES = 16 * 1024 * 1024
# The label of a request whose caller asked that nothing of it be kept (the Responses API's
# `store: false`): its stored record holds no inputs, parameters or outputs.
NOT_KEPT = ("store", "false")
# The error code of a request whose result MongoDB could never store (its record is failed).
RESULT_UNSTORABLE = "result_unstorable"
# Write errors that are the document's own (retrying it cannot help). Any other write
# error of a document is retried (counted against its deliveries); an error of the whole
# call is an outage.
DOCUMENT_ERRORS = {
    2: "BadValue",
    14: "TypeMismatch",
    52: "DollarPrefixedFieldName",
    121: "DocumentValidationFailure",
    10334: "BSONObjectTooLarge",
    17280: "KeyTooLong",
}
# Write errors of a document that are the server's state, not the document's: the call is
# an outage (retried without counting against the records).
SERVER_ERRORS = {
    6: "HostUnreachable",
    7: "HostNotFound",
    50: "MaxTimeMSExpired",
    89: "NetworkTimeout",
    91: "ShutdownInProgress",
    112: "WriteConflict",
    189: "PrimarySteppedDown",
    262: "ExceededTimeLimit",
    9001: "SocketException",
    10107: "NotWritablePrimary",
    11600: "InterruptedAtShutdown",
    11602: "InterruptedDueToReplStateChange",
    13435: "NotPrimaryNoSecondaryOk",
    13436: "NotPrimaryOrSecondary",
}


def pack_vector(vector: list[float]) -> Binary:
    return Binary.from_vector([float(x) for x in vector], BinaryVectorDtype.FLOAT32)


def unpack_vector(value: Any) -> list[float]:
    if isinstance(value, list):
        return value
    # Servers that do not keep the subtype hand back plain bytes.
    if not (isinstance(value, Binary) and value.subtype == VECTOR_SUBTYPE):
        value = Binary(bytes(value), VECTOR_SUBTYPE)
    return [float(x) for x in value.as_vector().data]


def pack_output(value: Any) -> Any:
    """An embedding output as MongoDB holds it: one vector as a BSON float32 vector; the
    packed vectors of a many-input request (gateway.protocol.vectors) with their bytes as
    BSON binary."""
    if is_packed(value):
        return {**value, "data": Binary(packed_bytes(value))}
    return pack_vector(value)


def unpack_output(value: Any) -> Any:
    """An embedding output as the record holds it (the packed bytes as base64 again)."""
    if is_packed(value):
        return {**value, "data": base64.b64encode(packed_bytes(value)).decode("ascii")}
    return unpack_vector(value)


def _vector_output(document: dict[str, Any]) -> str | None:
    index = document.get("index")
    return index.get("output") if isinstance(index, dict) else None


def record_to_document(record: ResultRecord) -> dict[str, Any]:
    # Fields at their defaults are left out (smaller documents, cheaper writes); the
    # record model puts them back on reading.
    document = {"_id": record.request_id, **record.model_dump(mode="python", exclude_defaults=True)}
    document["tenant"] = record.tenant  # always present: every read filters on it
    name = record.index.output if record.index else None
    if record.outputs is not None and name and record.outputs.get(name) is not None:
        document["outputs"] = {**record.outputs, name: pack_output(record.outputs[name])}
    return document


def record_from_document(document: dict[str, Any]) -> ResultRecord:
    fields = {k: v for k, v in document.items() if k != "_id"}
    name = _vector_output(document)
    outputs = fields.get("outputs")
    if name and isinstance(outputs, dict) and outputs.get(name) is not None:
        fields["outputs"] = {**outputs, name: unpack_output(outputs[name])}
    return ResultRecord.model_validate(fields)


def embedding_from_document(document: dict[str, Any]) -> tuple[str, list[float]] | None:
    """(space, vector) of a stored document that holds an embedding."""
    index, outputs = document.get("index"), document.get("outputs")
    if not isinstance(index, dict) or not isinstance(outputs, dict) or outputs.get(index.get("output")) is None:
        return None
    return index["space"], unpack_vector(outputs[index["output"]])


def expiry_of(record: ResultRecord, retention: timedelta) -> datetime:
    """When a stored result expires (the TTL index acts on it). The vector index computes
    the same for results it reads from the stream, so it forgets them when MongoDB does."""
    return (record.finished_at or record.created_at) + retention


class Unstorable(ValueError):
    """A result MongoDB can never store, whatever is retried: kind "unencodable", "too_large"
    or "refused" (MongoDB refused the document: DOCUMENT_ERRORS)."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(why)
        self.kind, self.why = kind, why


@dataclass
class InsertOutcome:
    stored: list[str] = field(default_factory=list)  # request ids now in MongoDB (new or already there)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> error
    # Request id -> (kind, why) of documents MongoDB can never take: "unencodable" (BSON
    # cannot encode it), "too_large" (neither sent) or "refused" (MongoDB refused it, a
    # DOCUMENT_ERRORS code). Not stored: retrying cannot help.
    refused: dict[str, tuple[str, str]] = field(default_factory=dict)
    # The call failed as a whole (out of reach, or any other error that is not a
    # document's): an outage; `failed` names every record sent.
    unavailable: bool = False


class ResultStore:
    def __init__(self, client: AsyncMongoClient, database: str, retention_s: int) -> None:
        self.client = client
        self.database = database
        self.retention = timedelta(seconds=retention_s)
        self.collection: AsyncCollection = client[database][RESULTS_COLLECTION]
        self.replica_set = False
        self.max_document_bytes = MAX_DOCUMENT_BYTES

    async def prepare(self) -> None:
        """Indexes, and majority writes where the server is a replica set."""
        hello = await self.client.admin.command("hello")
        self.max_document_bytes = int(hello.get("maxBsonObjectSize") or MAX_DOCUMENT_BYTES)
        if hello.get("setName"):
            self.replica_set = True
            self.collection = self.client[self.database].get_collection(
                RESULTS_COLLECTION, write_concern=WriteConcern("majority")
            )
        await self.collection.create_index("expires_at", expireAfterSeconds=0)
        await self.collection.create_index([("tenant", 1), ("created_at", -1)])

    async def ping(self) -> None:
        await self.client.admin.command("ping")

    # -- reading (gateway) ------------------------------------------------------------

    async def get(self, request_id: str, tenant: str | None = None) -> ResultRecord | None:
        query: dict[str, Any] = {"_id": request_id}
        if tenant is not None:
            query["tenant"] = tenant
        document = await self.collection.find_one(query)
        return record_from_document(document) if document else None

    async def get_many(self, request_ids: list[str], tenant: str | None = None) -> dict[str, ResultRecord]:
        query: dict[str, Any] = {"_id": {"$in": request_ids}}
        if tenant is not None:
            query["tenant"] = tenant
        found = {}
        async for document in self.collection.find(query):
            record = record_from_document(document)
            found[record.request_id] = record
        return found

    # -- writing (binder) -------------------------------------------------------------

    def as_stored(self, record: ResultRecord) -> ResultRecord:
        """The record as storing makes it: marked stored, with its expiry (its webhook's
        outcome, where it has one, comes later: set_webhook_status); of a request whose
        caller asked that nothing of it be kept (OpenAI's `store: false`), without its
        inputs, parameters and outputs (its status, usage and timings stay, for accounting)."""
        update: dict[str, Any] = {"stored": True, "expires_at": expiry_of(record, self.retention)}
        if record.metadata.get(NOT_KEPT[0]) == NOT_KEPT[1]:
            update |= {"inputs": {}, "parameters": {}, "outputs": None}
        return record.model_copy(update=update)

    def document(self, record: ResultRecord) -> dict[str, Any]:
        return record_to_document(self.as_stored(record))

    def encoded(self, record: ResultRecord) -> RawBSONDocument:
        """The record's document as BSON, encoded once here (insert_many sends it as it
        is). Raises Unstorable for a document MongoDB can never take."""
        try:
            raw = bson.encode(self.document(record), codec_options=self.client.codec_options)
        except Exception as exc:  # BSON cannot encode it (OverflowError, InvalidDocument, UnicodeEncodeError, ...)
            raise Unstorable("unencodable", f"BSON cannot encode it: {type(exc).__name__}: {exc}") from None
        if len(raw) > self.max_document_bytes:
            raise Unstorable(
                "too_large", f"its document is {len(raw)} bytes, over MongoDB's limit of {self.max_document_bytes}"
            )
        return RawBSONDocument(raw)

    async def insert(self, records: list[ResultRecord]) -> InsertOutcome:
        """Insert each record once. A write that MongoDB did not acknowledge (a
        write-concern error included) is a failure, never counted as stored; a record
        MongoDB can never take is refused (outcome.refused) and the others stored."""
        outcome = InsertOutcome()
        sendable: list[ResultRecord] = []
        documents: list[RawBSONDocument] = []
        for record in records:
            try:
                documents.append(self.encoded(record))
            except Unstorable as exc:
                outcome.refused[record.request_id] = (exc.kind, exc.why)
                continue
            sendable.append(record)
        if not sendable:
            return outcome
        try:
            await self.collection.insert_many(documents, ordered=False)
        except BulkWriteError as exc:
            for error in exc.details.get("writeErrors", []):
                code, request_id = error.get("code"), sendable[error["index"]].request_id
                message = error.get("errmsg", "write failed")
                if code in DOCUMENT_ERRORS:
                    outcome.refused[request_id] = ("refused", f"MongoDB refused it: {DOCUMENT_ERRORS[code]}: {message}")
                elif code != DUPLICATE_KEY:
                    outcome.failed[request_id] = message
                    if code in SERVER_ERRORS or "RetryableWriteError" in (error.get("errorLabels") or ()):
                        outcome.unavailable = True
            concern = exc.details.get("writeConcernErrors") or []
            if concern:
                message = concern[0].get("errmsg", "write concern not satisfied")
                for record in sendable:
                    outcome.failed.setdefault(record.request_id, f"write concern: {message}")
        except PyMongoError as exc:
            # Not a document's error (those come as BulkWriteError of an unordered insert):
            # out of reach, a primary stepping down, a timeout. Counting it against the
            # records' deliveries would dead-letter good results.
            outcome.unavailable = True
            for record in sendable:
                outcome.failed[record.request_id] = f"{type(exc).__name__}: {exc}"
        outcome.stored = [
            r.request_id for r in sendable if r.request_id not in outcome.failed and r.request_id not in outcome.refused
        ]
        return outcome

    def unstorable_record(self, record: ResultRecord, kind: str, why: str) -> ResultRecord:
        """What is stored for a request whose record MongoDB can never take: the request
        failed (`result_unstorable`, saying why), without its inputs, parameters and outputs
        (where what cannot be stored lives); its labels, usage and webhook kept. Raises
        Unstorable if even that cannot be stored."""
        message = f"the result could not be stored ({kind}): {why}"[:1000]
        failed = record.model_copy(
            update={
                "status": State.FAILED,
                "inputs": {},
                "parameters": {},
                "outputs": None,
                "index": None,
                "error": ErrorInfo(code=RESULT_UNSTORABLE, message=message),
            }
        )
        self.encoded(failed)
        return failed

    async def set_webhook_status(self, request_id: str, status: str, attempts: list[dict[str, Any]]) -> None:
        # The whole list is set (not $push) so a retried update cannot append twice.
        await self.collection.update_one(
            {"_id": request_id}, {"$set": {"webhook_status": status, "webhook_attempts": attempts}}
        )

    def embeddings(self) -> AsyncIterator[dict[str, Any]]:
        """Every stored result that holds an embedding (for rebuilding the index)."""
        cursor = self.collection.find(
            {"index": {"$exists": True}, "status": "succeeded"},
            {"index": 1, "outputs": 1, "tenant": 1, "expires_at": 1},
        )
        return cursor.__aiter__()
