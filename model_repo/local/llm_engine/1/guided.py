"""Guided decoding for the local engines, on llguidance: TensorRT-LLM's
`guided_decoding_guide_type` / `guided_decoding_guide` inputs.

The guide types are TensorRT-LLM's (GuidedDecodingParams::GuideType, as tensorrtllm_backend
names them): json (any JSON value), json_schema (the guide is a JSON schema), regex, and
ebnf_grammar (xgrammar's EBNF, `root ::= ...`, read through llguidance's GBNF converter).
structural_tag is not implemented here and is refused.

JSON is generated compact (no whitespace between tokens, "," and ":" as separators), which
keeps a weak model from padding its answer with whitespace until it runs out of tokens.

Each request gets a Guide: before every step the engine asks it for the tokens the grammar
allows next (all others get -inf), and after the step it consumes the chosen token. A guide
that is done (the grammar can go no further) ends the sequence.

A guide's budget: the gateway lets through at most 100,000 characters of it; llguidance's
limits (LIMITS) bound what compiling it and each step may cost, and a grammar over them does
not compile (or ends its sequence at the step that would pass them). Compiling walks the
grammar recursively on the calling thread: a chain of about 3,000 rules (a 60 kB guide)
overflows a thread's default 8 MB stack and kills the whole model process, every tenant's
sequences with it. So guides compile on one thread of their own whose stack holds any guide
the gateway lets through (10,000 chained rules, 200 kB, compile there in 0.35 s)."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import llguidance
import llguidance.numpy as lnp
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark

GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
_COMPACT = {"whitespace_flexible": False}
# llguidance's fuel is work: ~50k a millisecond to compile, ~14k a millisecond a step.
LIMITS = llguidance.LLParserLimits(
    initial_lexer_fuel=1_000_000,  # ~20 ms to build the lexer
    step_lexer_fuel=100_000,  # ~7 ms a token, for a sequence in a batch of others
    max_lexer_states=100_000,  # ~100-200 MB
    max_grammar_size=500_000,  # symbols
)
COMPILE_STACK_BYTES = 256 * 1024 * 1024  # address space; pages are used only as touched
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide


class _CompileThread:
    """One thread with a deep stack that runs the compilations, one at a time."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                threading.Thread(target=self._serve, name="guide-compile", daemon=True).start()
            finally:
                threading.stack_size(previous)

    def run(self, job: Callable[[], object]) -> object:
        done: Future[object] = Future()
        self._jobs.put((job, done))
        return done.result()

    def _serve(self) -> None:
        while True:
            job, done = self._jobs.get()
            try:
                done.set_result(job())
            except BaseException as exc:  # handed to the caller
                done.set_exception(exc)


class Guide:
    """One request's grammar state."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos = eos
        self._bitmask = lnp.allocate_token_bitmask(1, vocab_size)

    def mask(self) -> np.ndarray:
        """The tokens allowed next, as a bool vector of the vocabulary's size. A dead end (no
        token allowed) allows the end token only, so the sequence ends rather than failing."""
        lnp.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
        if not allowed.any() and 0 <= self.eos < self.vocab_size:
            allowed[self.eos] = True
        return allowed

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"guided decoding: token {token} is not allowed here ({self.matcher.get_error()})")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return bool(self.matcher.is_stopped())


class Guides:
    """Makes guides for one tokenizer (built on first use: about a second for a large
    vocabulary)."""

    def __init__(self, tokenizer_json_path: str, vocab_size: int, eos: int) -> None:
        self.path = tokenizer_json_path
        self.vocab_size = vocab_size
        self.eos = eos
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._compiler = _CompileThread()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                with open(self.path, encoding="utf-8") as handle:
                    text = handle.read()
                self._tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos)
            return self._tokenizer

    def new(self, guide_type: str, guide: str) -> Guide:
        """A guide for the request; ValueError for an unknown type or a guide that does not
        compile (within LIMITS). Compiled on the compile thread (the module's docstring says
        why)."""
        tokenizer = self.tokenizer()
        matcher = self._compiler.run(lambda: self._compile(tokenizer, guide_type, guide))
        assert isinstance(matcher, llguidance.LLMatcher)
        return Guide(matcher, self.vocab_size, self.eos)

    @staticmethod
    def _compile(tokenizer: llguidance.LLTokenizer, guide_type: str, guide: str) -> llguidance.LLMatcher:
        if guide_type == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema({}, defaults=_COMPACT)
        elif guide_type == "json_schema":
            try:
                schema = json.loads(guide)
            except ValueError as exc:
                raise ValueError(f"guided_decoding_guide is not a JSON schema: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("guided_decoding_guide must be a JSON schema object")
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
        elif guide_type == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(guide)
        elif guide_type == "ebnf_grammar":
            grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(guide))
        else:
            raise ValueError(f"guided_decoding_guide_type {guide_type!r} is not one of {', '.join(GUIDE_TYPES)}")
        if guide_type != "json" and not guide:
            raise ValueError(f"guided_decoding_guide_type {guide_type} needs a guided_decoding_guide")
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        except Exception as exc:  # (documented not to raise for grammar errors; some versions do)
            raise ValueError(f"guided_decoding_guide does not compile: {exc}") from None
        if matcher.is_error():
            raise ValueError(f"guided_decoding_guide does not compile: {matcher.get_error()}")
        return matcher
