"""Embedding models: one text or image in, one L2-normalised vector out (not decoupled);
or a list of up to MAX_INPUTS of them in one request (the /v1 list, the native list form
of `POST /infer`, as Triton's own API carries a batch), whose vectors come back as one
block of float32 bytes (gateway.protocol.vectors): one request, one run, one record."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any

import numpy as np
from pydantic import Field, PrivateAttr, StringConstraints, model_validator
from tokenizers import Tokenizer
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult

from gateway.protocol import IndexRef, Usage
from gateway.protocol.vectors import packed
from gateway.server.llm.tokenizer import token_ids
from gateway.server.models.base import BatchRow, ModelAdapter, Resume, Run, bytes_tensor, check
from gateway.server.models.inputs import (
    MAX_IMAGE_BASE64,
    MAX_TEXT_CHARS,
    ImageInputs,
    NoParameters,
    Strict,
    TextInputs,
    decode_image,
    refuse_huge_image,
)

# Inputs one request may carry (OpenAI's limit for an embeddings call); the body size
# limit (MAX_BODY_BYTES) bounds their text together.
MAX_INPUTS = 2048
Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]
# A token of a tokenizer's output covers at least one character of its normalised text
# (WordPiece) or one byte (byte-level BPE), and normalising (NFC or NFD, lower case) makes a
# text at most 3 times as many UTF-8 bytes; an ASCII text's normalised form is no longer than
# itself. So a text's tokens are at most its characters (ASCII) or this many times its bytes,
# plus the special tokens the tokenizer adds: admission's bound for a model that counts itself.
NON_ASCII_TOKENS_A_BYTE = 4
# Special tokens assumed added where no tokenizer says how many ([CLS]/[SEP], BOS/EOS: 2).
SPECIAL_TOKENS_MOST = 4
Image = Annotated[str, StringConstraints(max_length=MAX_IMAGE_BASE64)]


class TextListInputs(Strict):
    """Many texts in one request: one vector each, in order."""

    text: list[Text] = Field(min_length=1, max_length=MAX_INPUTS)


class ImageListInputs(Strict):
    """Many images (base64 PNG or JPEG) in one request: one vector each, in order."""

    image: list[Image] = Field(min_length=1, max_length=MAX_INPUTS)
    _data: list[bytes] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _decode(self) -> ImageListInputs:
        data = []
        for index, value in enumerate(self.image):
            try:
                one = decode_image(value)
            except ValueError as exc:
                raise ValueError(f"image[{index}]: {exc}") from None
            refuse_huge_image(one)
            data.append(one)
        self._data = data
        return self

    @property
    def data(self) -> list[bytes]:
        return self._data


Prepared = TextInputs | ImageInputs | TextListInputs | ImageListInputs


def _load_tokenizer(directory: str | None) -> Tokenizer | None:
    path = Path(directory) / "tokenizer.json" if directory else None
    if path is None or not path.exists():
        return None
    tokenizer = Tokenizer.from_file(str(path))
    # It only counts usage: the text's own tokens (up to the truncation its tokenizer.json
    # sets), not the pad tokens it may add (MiniLM's pads every text to 128).
    tokenizer.no_padding()
    return tokenizer


class EmbeddingRun(Run):
    def __init__(self, adapter: EmbeddingAdapter, prepared: Prepared) -> None:
        self.triton_model = adapter.triton_model
        self.adapter = adapter
        self.prepared = prepared
        self.vector: list[float] | None = None
        # A many-input request's vectors: float32, one row per input, as Triton sent them.
        self.matrix: np.ndarray | None = None
        # The inputs' tokens as the model counted them (its count_output), when it answered it.
        self.tokens: int | None = None

    @property
    def many(self) -> bool:
        return isinstance(self.prepared, TextListInputs | ImageListInputs)

    def _rows(self) -> list[bytes]:
        prepared = self.prepared
        if isinstance(prepared, ImageListInputs):
            return prepared.data
        if isinstance(prepared, TextListInputs):
            return [text.encode("utf-8") for text in prepared.text]
        if isinstance(prepared, ImageInputs):
            return [prepared.data]
        return [prepared.text.encode("utf-8")]

    def inputs(self, stream: bool) -> list[InferInput]:
        rows = self._rows()
        if len(rows) == 1:
            return [bytes_tensor(self.adapter.input_name, rows[0])]
        batch = InferInput(self.adapter.input_name, [len(rows), 1], "BYTES")
        batch.set_data_from_numpy(np.array(rows, dtype=np.object_).reshape(-1, 1))  # whole, not row by row
        return [batch]

    def outputs(self) -> list[InferRequestedOutput]:
        names = [self.adapter.output_name] + ([self.adapter.count_output] if self.adapter.count_output else [])
        return [InferRequestedOutput(name) for name in names]

    def batch_row(self) -> BatchRow:
        rows = self._rows()
        values = tuple(rows) if self.many else ()
        return BatchRow(self.adapter.input_name, rows[0], self.adapter.output_name, values, self.adapter.count_output)

    def take(self, result: InferResult) -> list:
        found = result.as_numpy(self.adapter.output_name)
        counts = result.as_numpy(self.adapter.count_output) if self.adapter.count_output else None
        # (Rows of a shared call, replicas/batching.py, carry the vectors only: None here.)
        self.tokens = int(counts.sum()) if counts is not None else None
        if self.many:
            rows = len(self._rows()) if found is None else found.shape[0]
            self.matrix = np.ascontiguousarray(np.asarray(found, dtype="<f4").reshape(rows, -1))
        else:
            self.vector = found.reshape(-1).astype(float).tolist()
        return []

    def final(self) -> tuple[dict[str, Any], Usage | None]:
        """The vector (a many-input request: its vectors packed as float32 bytes) and the usage.
        A model that counts its inputs' tokens (count_output) settles the usage here, to the
        count it answered (or, where its answer came without it, the gateway's tokenizer's),
        replacing the upper bound admission reserved; otherwise the tokens were counted
        exactly at submission and come from the request (Runner.partial)."""
        name = self.adapter.output_name
        usage = self._usage()
        if self.matrix is not None:
            rows, dim = self.matrix.shape
            return {name: packed(self.matrix.tobytes(), rows, dim)}, usage
        outputs = {name: self.vector} if self.vector is not None else {}
        return outputs, usage

    def _usage(self) -> Usage | None:
        if self.adapter.count_output is None:
            return None
        tokens = self.tokens if self.tokens is not None else self.adapter.count_tokens(self.prepared)
        return Usage(prompt_tokens=tokens) if tokens is not None else None


class EmbeddingAdapter(ModelAdapter):
    kind = "embedding"

    def __init__(
        self,
        name: str,
        triton_model: str,
        *,
        input_kind: str,
        output_name: str,
        space: str | None,
        dimensions: int | None = None,
        tokenizer_dir: str | None = None,
        count_output: str | None = None,
        max_input_tokens: int | None = None,
    ) -> None:
        super().__init__(name, triton_model)
        # The model's tokenizer, where one is configured, only to count usage.
        self.tokenizer = _load_tokenizer(tokenizer_dir)
        self.input_kind = input_kind  # "text" or "image"
        # The output that carries each text's tokens as the model's own tokenizer counted
        # them: the usage then comes from it and the gateway tokenizes nothing on the way.
        self.count_output = count_output if input_kind == "text" else None
        # The most tokens the model counts for one text (its truncation), if known.
        self.max_input_tokens = max_input_tokens
        if self.tokenizer is not None and max_input_tokens is not None:
            # Where the gateway counts, it counts what the model embeds: its truncation.
            self.tokenizer.enable_truncation(max_input_tokens)
        self._specials = len(self.tokenizer.encode("").ids) if self.tokenizer is not None else SPECIAL_TOKENS_MOST
        self.input_name = "image" if input_kind == "image" else "text"
        self.output_name = output_name
        self.space = space
        self.dimensions = dimensions
        self.index = IndexRef(space=space, output=output_name) if space else None
        self._inputs = ImageInputs if input_kind == "image" else TextInputs
        self._list_inputs = ImageListInputs if input_kind == "image" else TextListInputs

    def validate(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> Prepared:
        """One input (its vector a list of floats in the record), or a list of them under
        the same name (one request: the record holds their vectors packed). A bad input of
        a list refuses the request, naming its index."""
        many = isinstance(inputs.get(self.input_name), list)
        prepared = check(self._list_inputs if many else self._inputs, inputs, self.name, "invalid_inputs")
        check(NoParameters, parameters, self.name, "invalid_inputs")
        return prepared

    def inputs_count(self, prepared: Prepared) -> int:
        if isinstance(prepared, TextListInputs):
            return len(prepared.text)
        if isinstance(prepared, ImageListInputs):
            return len(prepared.image)
        return 1

    def stored_inputs(self, prepared: Prepared) -> dict[str, Any]:
        if isinstance(prepared, ImageInputs):
            return {"image": _digest(prepared.data)}
        if isinstance(prepared, ImageListInputs):
            return {"image": [_digest(data) for data in prepared.data]}
        return prepared.model_dump()

    def new_run(self, prepared: Prepared, resume: Resume | None = None) -> Run:
        return EmbeddingRun(self, prepared)

    def prompt_tokens(self, prepared: Prepared) -> int | None:
        """What admission charges: the exact count, or, for a model that counts itself, an
        upper bound from the texts' lengths (never below the count; settled in final())."""
        if self.count_output is None:
            return self.count_tokens(prepared)
        if isinstance(prepared, TextListInputs):
            return sum(self._most_tokens(text) for text in prepared.text)
        return self._most_tokens(prepared.text) if isinstance(prepared, TextInputs) else None

    def reserved_tokens(self, inputs: dict[str, Any]) -> int | None:
        """What admission reserved for a request of these inputs (its record's, as stored:
        the texts themselves) where it reserved a bound instead of the count (a model that
        counts its own tokens): the bound prompt_tokens gave; None where it charged the count."""
        if self.count_output is None:
            return None
        text = inputs.get("text")
        if isinstance(text, list):
            return sum(self._most_tokens(one) for one in text if isinstance(one, str))
        return self._most_tokens(text) if isinstance(text, str) else None

    def _most_tokens(self, text: str) -> int:
        most = self._specials + (len(text) if text.isascii() else NON_ASCII_TOKENS_A_BYTE * len(text.encode()))
        return most if self.max_input_tokens is None else min(most, self.max_input_tokens)

    def count_tokens(self, prepared: Prepared) -> int | None:
        if self.tokenizer is None:
            return None
        if isinstance(prepared, TextListInputs):  # one call of the tokenizer for them all
            return sum(len(e) for e in self.tokenizer.encode_batch_fast(prepared.text))
        if not isinstance(prepared, TextInputs):
            return None
        return len(token_ids(self.tokenizer, prepared.text))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "input": self.input_kind, "space": self.space, "dimensions": self.dimensions}


def _digest(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
