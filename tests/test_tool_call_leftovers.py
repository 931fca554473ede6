"""The tool-call parser's leftovers (gateway.server.llm.tools): stray text beside a call in its
block, arguments that are not an object, and a bare JSON answer held back only while it may
still be a call. Pure logic: the parser on text, as the chat and Responses paths feed it."""

from __future__ import annotations

import json

import pytest

from gateway.server.llm import tools
from gateway.server.llm.tools import StreamParser, ToolCall, ToolFormat

OFFERED = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
PARIS = {"city": "Paris"}
WEATHER = ToolCall("get_weather", json.dumps(PARIS))


def _block(inner: str) -> str:
    return f"<tool_call>\n{inner}\n</tool_call>"


def test_stray_text_beside_a_call_inside_its_block_is_text_and_the_call_a_call() -> None:
    call = json.dumps({"name": "get_weather", "arguments": PARIS})
    text, calls = tools.parse("Looking. " + _block(f"Sure: {call} done"), ToolFormat.HERMES, OFFERED)
    assert calls == [WEATHER]
    assert text.split() == ["Looking.", "Sure:", "done"]


def test_a_block_of_text_alone_stays_text() -> None:
    text = _block("I would call get_weather here.")
    assert tools.parse(text, ToolFormat.HERMES, OFFERED) == (text, [])


def test_arguments_that_are_not_json_make_no_call() -> None:
    text = _block(json.dumps({"name": "get_weather", "arguments": "Paris, please"}))
    assert tools.parse(text, ToolFormat.HERMES, OFFERED) == (text, [])


@pytest.mark.parametrize("arguments", [[1, 2], 3, "[1]"])
def test_arguments_that_are_not_an_object_make_no_call(arguments) -> None:
    text = _block(json.dumps({"name": "get_weather", "arguments": arguments}))
    assert tools.parse(text, ToolFormat.HERMES, OFFERED)[1] == []


def test_json_encoded_arguments_are_the_object_they_hold() -> None:
    text = _block(json.dumps({"name": "get_weather", "arguments": json.dumps(PARIS)}))
    assert tools.parse(text, ToolFormat.HERMES, OFFERED) == ("", [WEATHER])


def test_empty_string_arguments_are_an_empty_object() -> None:
    text = _block(json.dumps({"name": "get_weather", "arguments": ""}))
    assert tools.parse(text, ToolFormat.HERMES, OFFERED) == ("", [ToolCall("get_weather", "{}")])


@pytest.mark.parametrize("fmt", [ToolFormat.LLAMA3_JSON, None])
def test_a_json_answer_is_streamed_once_it_cannot_be_a_call(fmt) -> None:
    parser = StreamParser(fmt, OFFERED)
    assert parser.feed("{") == []
    assert parser.feed(' "result": ') == ['{ "result": ']
    assert parser.feed("[1, 2]}") == ["[1, 2]}"]


def test_a_mistral_list_that_holds_no_call_object_is_streamed_at_once() -> None:
    parser = StreamParser(ToolFormat.MISTRAL, OFFERED)
    assert parser.feed("[1") == ["[1"]


def test_a_bare_call_is_still_held_to_the_end_and_read() -> None:
    parser = StreamParser(ToolFormat.LLAMA3_JSON, OFFERED)
    text = json.dumps({"name": "get_weather", "parameters": PARIS})
    assert [item for char in text for item in parser.feed(char)] == []
    assert parser.finish() == [WEATHER]
