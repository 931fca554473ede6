"""A model's tokenizer, as Triton's preprocessing uses it: the Hugging Face tokenizer
directory (tokenizer.json, tokenizer_config.json, generation_config.json, config.json).

Chat templates are rendered the way transformers renders them (a sandboxed Jinja2
environment with trim_blocks, lstrip_blocks and raise_exception), without importing
transformers or torch into the gateway."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from gateway.server.llm.tools import MARKER_TOKENS, as_plain_messages, for_template, renders_tools, tool_format


class ChatTemplateError(ValueError):
    pass


def token_ids(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """The text's token ids, as `tokenizer.encode(text).ids`. `encode` holds the
    interpreter's lock for the whole text and builds character offsets nothing here
    reads; `encode_batch_fast` gives the same ids without them (25-40% less CPU) and lets
    go of the lock, so a long text tokenized in a worker thread leaves the event loop
    serving (gateway.server.models.tokenize_pool.off_the_loop_if_long)."""
    return tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class LlmTokenizer:
    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        tokenizer_file = self.directory / "tokenizer.json"
        if not tokenizer_file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {self.directory}")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(self.directory / "tokenizer_config.json")
        special = _read_json(self.directory / "special_tokens_map.json")
        generation = _read_json(self.directory / "generation_config.json")
        model = _read_json(self.directory / "config.json")
        self.bos_token = _token_text(config.get("bos_token")) or _token_text(special.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token")) or _token_text(special.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token")) or _token_text(special.get("pad_token"))
        eos = generation.get("eos_token_id", model.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is None and self.eos_token is not None:
            eos = self.tokenizer.token_to_id(self.eos_token)
        self.end_id: int = int(eos) if eos is not None else -1
        pad = generation.get("pad_token_id", model.get("pad_token_id"))
        if pad is None and self.pad_token is not None:
            pad = self.tokenizer.token_to_id(self.pad_token)
        self.pad_id: int = int(pad) if pad is not None else max(self.end_id, 0)
        # The engine's context: what the model was trained for.
        self.context_length: int = int(
            model.get("max_position_embeddings") or model.get("n_positions") or config.get("model_max_length") or 2048
        )
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (self.directory / "chat_template.jinja").exists():
            template = (self.directory / "chat_template.jinja").read_text()
        self.chat_template: str | None = template
        # How the template takes tools, and how the model writes calls (gateway.server.llm.tools).
        self.renders_tools = renders_tools(template)
        markers = [token for token in MARKER_TOKENS if self.tokenizer.token_to_id(token) is not None]
        self.tool_format = tool_format(template, markers)
        self._bytes: dict[int, bytes] = {}  # token id -> its bytes (token_bytes)
        # The vocabulary's longest entry: no token stands for more characters (a byte-level
        # entry's characters are its bytes, at least the characters it decodes to).
        self.longest_token = max((len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return token_ids(self.tokenizer, text, add_special_tokens=add_special_tokens)

    def fewest_tokens(self, text: str) -> int:
        """A floor on the tokens `text` encodes to, without encoding it: its characters over
        the longest entry's, halved again for a normalizer that may merge characters. A
        prompt far past the context is refused by it before the tokenizer spends seconds."""
        return len(text) // (2 * self.longest_token)

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        """A prompt's token ids. A chat prompt that its template began with the BOS token is
        encoded without the tokenizer's own special tokens (as transformers encodes a rendered
        chat), or it would start with two BOS; text_input gets them, as before."""
        rendered_bos = chat and bool(self.bos_token) and text.startswith(self.bos_token or "")
        return self.encode(text, add_special_tokens=not rendered_bos)

    def encode_words(self, words: list[str]) -> list[list[int]]:
        return [self.encode(w, add_special_tokens=False) for w in words]

    def exact_words(self, words: list[str]) -> list[list[int]]:
        """The words whose token ids decode to exactly their text: an engine that stops on
        those ids has generated the text (SentencePiece's leading space, or a word that is
        tokenized otherwise in context, would make the engine stop where the text has no
        stop sequence, or miss one)."""
        found = []
        for word, ids in zip(words, self.encode_words(words), strict=True):
            if ids and self.tokenizer.decode(ids, skip_special_tokens=False) == word:
                found.append(ids)
        return found

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation as the model's prompt. Tools (OpenAI's function tool objects) and
        tool calls and results in the messages are rendered by the template when it knows
        tools, else as the generic Hermes-style prompt (gateway.server.llm.tools)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; send text_input instead of messages")
        if self.renders_tools:
            messages, offered = for_template(messages, self.tool_format), tools or None
        else:
            messages, offered = as_plain_messages(messages, tools), None
        try:
            return _compile(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                tools=offered,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a byte-level BPE token may hold part of a character;
        decoding it alone would give U+FFFD)."""
        found = self._bytes.get(token)
        if found is None:
            found = self._bytes[token] = _token_bytes(self.tokenizer, token)
        return found


def word_list(words: list[list[int]]) -> np.ndarray | None:
    """TensorRT-LLM's word-list tensor, [1, 2, N] int32: row 0 the words' token ids end
    to end, row 1 each word's end offset, padded with -1 (None when there are no words)."""
    ids: list[int] = []
    offsets: list[int] = []
    for word in words:
        if word:
            ids.extend(word)
            offsets.append(len(ids))
    if not ids:
        return None
    offsets += [-1] * (len(ids) - len(offsets))
    return np.array([[ids, offsets]], dtype=np.int32)


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_table()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_bytes(tokenizer: Tokenizer, token: int) -> bytes:
    piece = tokenizer.id_to_token(token)
    if piece is None:
        return b""
    decoder = json.loads(tokenizer.decoder.__getstate__()).get("type") if tokenizer.decoder else None
    if decoder == "ByteLevel" and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:  # SentencePiece byte fallback
        return bytes([int(fallback.group(1), 16)])
    text = tokenizer.decode([token], skip_special_tokens=False)
    if "\u2581" in piece:  # SentencePiece's word boundary
        text = piece.replace("\u2581", " ")
    return text.encode("utf-8")


def _raise(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _compile(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
