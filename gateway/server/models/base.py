"""What every model adapter provides. An adapter validates a request (before it is
queued) and, for each run on a replica, makes a Run: the Triton inputs to send, what to
emit as each response arrives, and the outputs at the end."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult

from gateway.protocol import IndexRef, Usage
from gateway.protocol.storable import STORAGE_REFUSALS

# Inputs with more text than this (characters, all their strings together) are validated
# in a thread of the tokenize pool (gateway.server.models.tokenize_pool). Validating an
# LLM request tokenizes its prompt: ~4 ms for 9,000 characters on the 2-core machine,
# ~3 s for the 8 MB a body may hold, and the event loop would serve no other call
# meanwhile. Below it the thread's hand-off costs more than it saves.
LONG_INPUT_CHARS = 8192


def text_chars(value: Any, most: int = LONG_INPUT_CHARS) -> int:
    """Characters in the strings of a JSON-like value, counted until there are over `most`."""
    total, pending = 0, [value]
    while pending and total <= most:
        item = pending.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return total


class InvalidInput(Exception):
    """The request cannot be served as asked (422, before anything is queued)."""

    def __init__(self, code: str, message: str, details: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.details = code, message, details


class RunError(Exception):
    """A run cannot go on, whatever replica it tries (the request fails with this code)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Piece:
    """Generated text to emit as a token event; ids are the token ids behind it."""

    text: str
    ids: tuple[int, ...] = ()


@dataclass
class Resume:
    """What an earlier, interrupted run of the same request already sent: how many
    pieces, and (engine path) the token ids behind them."""

    pieces: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class BatchRow:
    """One request as rows of a call shared with others of its model: its BYTES input
    of shape [1] per row and the name of its one output (replicas/batching.py)."""

    input_name: str
    value: bytes
    output_name: str
    # A many-input request's inputs, one row each (value is then its first): its rows go
    # into as many calls as the model's max_batch_size needs, within its one run.
    values: tuple[bytes, ...] = ()
    # A second output of one row per input (an embedding model's token counts), if any.
    count_name: str | None = None

    @property
    def rows(self) -> tuple[bytes, ...]:
        return self.values or (self.value,)


class Run:
    """One attempt of one request on one replica."""

    triton_model: str
    decoupled: bool = False

    def inputs(self, stream: bool) -> list[InferInput]:
        raise NotImplementedError

    def outputs(self) -> list[InferRequestedOutput]:
        raise NotImplementedError

    def take(self, result: InferResult) -> list[Piece]:
        """A response from Triton; returns the pieces of text to emit (if any)."""
        raise NotImplementedError

    def batch_row(self) -> BatchRow | None:
        """This run as one row of a call shared with other requests of its model (its input
        one BYTES element, its output one tensor: replicas/batching.py); None: a call of
        its own."""
        return None

    def flush(self) -> list[Piece]:
        """Pieces held back until the end (an unfinished character), once the last
        response has arrived."""
        return []

    def final(self) -> tuple[dict[str, Any], Usage | None]:
        """The outputs (and token usage) once the last response has arrived; also what
        was produced so far, for a run that was cut short."""
        raise NotImplementedError

    @property
    def done(self) -> bool:
        """The answer is complete before the replica's stream ended (a stop sequence was
        found): the runner closes the stream, which stops the generation."""
        return False

    @property
    def produced(self) -> bool:
        """Whether anything reached the client already (a retry must not repeat it)."""
        return False

    def carry_from(self, previous: Run) -> None:
        """Continue where `previous` (a failed run of the same request) stopped."""


class ModelAdapter:
    """A model clients can name. Subclasses: embedding, llm (engine or ensemble)."""

    kind: str = ""
    decoupled: bool = False
    # Where this model's embeddings go in the vector index.
    index: IndexRef | None = None
    # A model on the same Triton that ends a running request by its id (see
    # llm_generator), for ensembles, which do not pass cancellation on.
    stop_model: str | None = None
    # A new run can continue an interrupted one from the tokens it sent (engine path).
    resumable: bool = False
    # Its prefix cache is salted per tenant: the submission sets parameters.cache_salt.
    salted_cache: bool = False
    # Its engine keeps one prefix cache for all tenants (an LLM whose engine takes no salt,
    # spec.cache_salt false): how soon a prompt's first token comes tells whether another
    # tenant sent the same prefix, so its records carry no time to first token.
    shared_prefix_cache: bool = False

    def __init__(self, name: str, triton_model: str) -> None:
        self.name = name
        self.triton_model = triton_model

    def validate(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> Any:
        """Raises InvalidInput. Returns what new_run() takes."""
        raise NotImplementedError

    def stored_inputs(self, prepared: Any) -> dict[str, Any]:
        """The inputs as stored with the result (images by digest, not bytes)."""
        raise NotImplementedError

    def new_run(self, prepared: Any, resume: Resume | None = None) -> Run:
        raise NotImplementedError

    def prompt_tokens(self, prepared: Any) -> int | None:
        """The request's prompt tokens (charged against tokens per minute at admission), if
        this model counts them."""
        return None

    def deterministic(self, prepared: Any) -> bool:
        """Whether running the request again gives the same output (greedy or seeded)."""
        return True

    def unseeded(self, prepared: Any) -> bool:
        """Whether the request samples without a seed of its own: the submission gives it a
        fresh one (seed_with), stored with it, so that every run of it draws alike."""
        parameters = getattr(prepared, "parameters", None)
        return bool(getattr(parameters, "unseeded", False))

    def seed_with(self, prepared: Any, seed: int) -> None:
        """Set the seed of a prepared request (unseeded() was true)."""
        prepared.parameters = prepared.parameters.model_copy(update={"seed": seed})

    def describe(self) -> dict[str, Any]:
        return {"id": self.name, "kind": self.kind, "triton_model": self.triton_model}


def check(model: type[BaseModel], value: dict[str, Any], what: str, code: str) -> Any:
    """Validate with pydantic, turning its error into InvalidInput."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = f"{what}: {where}: {first['msg']}" if where else f"{what}: {first['msg']}"
        plain = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        # What storage cannot hold has a code of its own (the same on every API).
        raise InvalidInput(first["type"] if first["type"] in STORAGE_REFUSALS else code, message, plain) from None


def tensor(name: str, value: np.ndarray, datatype: str) -> InferInput:
    item = InferInput(name, list(value.shape), datatype)
    item.set_data_from_numpy(value)
    return item


@functools.lru_cache(maxsize=4096)
def scalar_tensor(name: str, value: bool | int | float, dtype: type[np.generic], datatype: str) -> InferInput:
    """A [[value]] tensor, built once and shared by every call that sends the same one (a run's
    flags, ids and sampling values repeat from request to request; building one costs ~7 µs).
    Shared safely: tritonclient copies an input into each request it sends and changes it
    never. Not for values that rarely repeat (a random seed): each would take a place here."""
    return tensor(name, np.array([[value]], dtype=dtype), datatype)


def requested_outputs(names: tuple[str, ...]) -> list[InferRequestedOutput]:
    """The outputs a call asks for, each built once (shared as scalar_tensor's)."""
    return list(_requested_outputs(names))


@functools.lru_cache(maxsize=64)
def _requested_outputs(names: tuple[str, ...]) -> tuple[InferRequestedOutput, ...]:
    return tuple(InferRequestedOutput(name) for name in names)


def bytes_tensor(name: str, value: bytes) -> InferInput:
    return tensor(name, np.array([[value]], dtype=np.object_), "BYTES")
