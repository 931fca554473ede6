"""What storage can hold of a free-form JSON value (a tool's JSON schema, a response format's
schema, an item given back as it was): every number must fit BSON, where records, responses
and conversations are stored. JSON itself has no bound: Python's parser reads
100000000000000000000 as an exact integer and NaN, Infinity or 1e400 as non-finite floats,
and MongoDB refuses an integer past 64 bits (PyMongo's OverflowError) where nothing but
validation would have caught it.

Nor is JSON's nesting bounded, and MongoDB refuses a document nested past 100 levels: a
free-form value may nest at most NESTING_MOST levels, room left for the record around it.

`first_unstorable` walks a value and names the first number storage cannot hold, or the
first container nested too deep; the `StorableDict` and `StorableList` types refuse such
a value at validation with the error type UNSTORABLE_NUMBER or UNSTORABLE_NESTING (the
API answers each with the stable code of that name)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

# BSON's integers are 64-bit (int64); its other numbers are finite-or-not doubles, but a
# non-finite one cannot be written back as JSON (the API's answers, the webhooks' bodies).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
UNSTORABLE_NUMBER = "unstorable_number"
UNSTORABLE_NESTING = "nested_too_deep"
STORAGE_REFUSALS = frozenset({UNSTORABLE_NUMBER, UNSTORABLE_NESTING})
# Levels a free-form value may nest: MongoDB holds 100 in a document, and the record, a
# stored response or a conversation item holds such a value a few levels down.
NESTING_MOST = 64
# An integer up to this many bits is shown in a message; a longer one by its size (str()
# of an integer of over 4,300 digits raises, and nobody reads that many).
_SHOWN_BITS = 128


@dataclass(frozen=True)
class Unstorable:
    """The first number of a value storage cannot hold: where it is and why."""

    loc: tuple[str | int, ...]
    why: str
    code: str = UNSTORABLE_NUMBER

    @property
    def path(self) -> str:
        """The location as a field path: properties.n.maximum, enum[2]; "" for the value itself."""
        text = ""
        for part in self.loc:
            text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
        return text


def _why(value: int | float) -> str | None:
    """What is wrong with a number, or None (said of it: "<path> is ...")."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{value}, not a finite number"
    if INT64_MIN <= value <= INT64_MAX:
        return None
    shown = str(value) if value.bit_length() <= _SHOWN_BITS else f"an integer of {value.bit_length()} bits"
    return f"{shown}, outside the 64-bit integers storage holds ({INT64_MIN} to {INT64_MAX})"


def first_unstorable(value: Any) -> Unstorable | None:
    """The first number in a JSON value (dicts, lists, strings, numbers, booleans, None)
    that storage cannot hold, or its first container nested past NESTING_MOST levels,
    depth first; None when storage holds it all. Iterative: a
    value nested as deep as the JSON parser allows is walked without recursion."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while stack:
        loc, item = stack.pop()
        if isinstance(item, dict | list | tuple) and len(loc) >= NESTING_MOST:
            deep = f"nested more than {NESTING_MOST} levels deep, past what storage holds"
            return Unstorable(loc, deep, UNSTORABLE_NESTING)
        if isinstance(item, dict):
            stack.extend(((*loc, str(key)), inner) for key, inner in reversed(item.items()))
        elif isinstance(item, list | tuple):
            stack.extend(((*loc, index), inner) for index, inner in reversed(list(enumerate(item))))
        elif isinstance(item, int | float) and not isinstance(item, bool):
            why = _why(item)
            if why is not None:
                return Unstorable(loc, why)
    return None


def refuse_unstorable(value: Any) -> Any:
    """A pydantic validator: the value as it is, or the error UNSTORABLE_NUMBER (or
    UNSTORABLE_NESTING) naming where in it the number (or the container) is."""
    found = first_unstorable(value)
    if found is None:
        return value
    raise PydanticCustomError(found.code, "{path} is {why}", {"path": found.path or "the value", "why": found.why})


# A free-form JSON object or list accepted from a caller, refused when storage cannot hold it.
StorableDict = Annotated[dict[str, Any], AfterValidator(refuse_unstorable)]
StorableList = Annotated[list[Any], AfterValidator(refuse_unstorable)]
