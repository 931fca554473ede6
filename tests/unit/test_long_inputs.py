"""Long inputs are validated (tokenized) in a worker thread, short ones at once; the token
ids the gateway counts are those of the tokenizer's own encode."""

from __future__ import annotations

import threading
from pathlib import Path

from tokenizers import Tokenizer

from gateway.server.llm.tokenizer import token_ids
from gateway.server.models.base import LONG_INPUT_CHARS, text_chars
from gateway.server.models.tokenize_pool import off_the_loop_if_long
from gateway.stack.stack import minilm_dir


def test_the_characters_of_every_string_in_nested_inputs_are_counted() -> None:
    inputs = {"messages": [{"role": "user", "content": "hello"}, {"role": "tool", "content": None}], "n": 3}
    assert text_chars(inputs) == len("user") + len("hello") + len("tool")


def test_counting_stops_once_the_characters_are_over_the_limit() -> None:
    inputs = ["x" * 10] * 1000
    assert 10 < text_chars(inputs, most=10) <= 20


async def test_long_inputs_are_worked_on_in_another_thread() -> None:
    loop_thread = threading.get_ident()
    worked_in = await off_the_loop_if_long(
        {"text_input": "x" * (LONG_INPUT_CHARS + 1)}, threading.get_ident, tenant=None
    )
    assert worked_in != loop_thread


async def test_short_inputs_are_worked_on_at_once_in_the_loop_thread() -> None:
    worked_in = await off_the_loop_if_long({"text_input": "x" * LONG_INPUT_CHARS}, threading.get_ident, tenant=None)
    assert worked_in == threading.get_ident()


def test_token_ids_are_those_of_the_tokenizers_encode() -> None:
    tokenizer = Tokenizer.from_file(str(Path(minilm_dir()) / "tokenizer.json"))
    for text in ["", "a cat sits on the mat", "naïve café 日本語 🤖 " * 40, "[CLS] x [SEP]"]:
        for special in (True, False):
            expected = tokenizer.encode(text, add_special_tokens=special).ids
            assert token_ids(tokenizer, text, add_special_tokens=special) == expected
