"""Tool calls per chat-template family (gateway.server.llm.tools), without any server: which
family a template and its tokenizer belong to, how each shipped template renders tools, a
call and its result, how each family's output is read (whole and streamed a character at a
time), forced calls' schemas and cut-off forced calls, and the prompt's single BOS.

The templates under tests/data/chat_templates are written for these tests, each in its
family's style (not copies of the models' own); each family's *.tokens.json lists the
special tokens its tokenizer has, and the tiny tokenizers here are byte-level ones with
those tokens added."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from gateway.protocol import ResultRecord, State
from gateway.server.llm import tools
from gateway.server.llm.tokenizer import LlmTokenizer
from gateway.server.llm.tools import StreamParser, ToolCall, ToolFormat
from gateway.server.openai.chat import ChunkStream, chat_completion
from gateway.server.openai.schemas import ChatCompletionRequest
from gateway.stack.weights import DEMO_CHAT_TEMPLATE

DATA = Path(__file__).parent / "data" / "chat_templates"
HERMES, LLAMA, MISTRAL = ToolFormat.HERMES, ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL
# template file -> (its tokenizer's tokens file, the family it belongs to)
TEMPLATES = {
    "qwen2.5": ("qwen2.5", HERMES),
    "llama3.1_json": ("llama3", LLAMA),
    "llama3.2_json": ("llama3", LLAMA),
    "mistral_v0.3": ("mistral_v0.3", MISTRAL),
}


def _function(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')}.",
            "parameters": {"type": "object", "properties": properties, "required": list(properties)},
        },
    }


WEATHER = _function("get_weather", {"city": {"type": "string"}})
TIME = _function("get_time", {"zone": {"type": "string"}})
OFFERED = [WEATHER, TIME]
PARIS, UTC_ZONE = {"city": "Paris"}, {"zone": "UTC"}
CALL_ID = "call_0123456789abcdef01234567"
CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temperature_c": 21}'},
]


def _template(name: str) -> str:
    return (DATA / f"{name}.jinja").read_text()


def _tokens(name: str) -> dict[str, Any]:
    return json.loads((DATA / f"{name}.tokens.json").read_text())


def _tokenizer(directory: Path, template: str, tokens: dict[str, Any]) -> LlmTokenizer:
    """A byte-level tokenizer with the family's special tokens (and, where it has one, the
    BOS its post-processor adds, as Llama 3's does), saved as a model directory."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    raw = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(tokens["special_tokens"])
    bos = tokens["bos_token"]
    if bos:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, raw.token_to_id(bos))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    raw.save(str(directory / "tokenizer.json"))
    config = {"chat_template": template, "bos_token": bos, "eos_token": tokens["eos_token"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return LlmTokenizer(directory)


def _shipped(tmp_path: Path, name: str) -> LlmTokenizer:
    return _tokenizer(tmp_path / name, _template(name), _tokens(TEMPLATES[name][0]))


# -- which family ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_shipped_template_renders_tools(name: str) -> None:
    assert tools.renders_tools(_template(name))


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_each_shipped_template_is_detected_as_its_family(name: str) -> None:
    tokens, family = TEMPLATES[name]
    assert tools.tool_format(_template(name), _tokens(tokens)["special_tokens"]) is family


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_tokenizer_directory_knows_its_family(tmp_path: Path, name: str) -> None:
    tokenizer = _shipped(tmp_path, name)
    assert tokenizer.renders_tools and tokenizer.tool_format is TEMPLATES[name][1]


def test_a_chatml_template_without_tools_keeps_the_generic_hermes_prompt(tmp_path: Path) -> None:
    tokenizer = _tokenizer(tmp_path, DEMO_CHAT_TEMPLATE, _tokens("qwen2.5"))
    assert not tokenizer.renders_tools and tokenizer.tool_format is HERMES
    prompt = tokenizer.render_chat(CONVERSATION, tools=[WEATHER])
    assert prompt.startswith("<|im_start|>system\nYou may call these functions:\n<tools>\n")
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert '<|im_start|>user\n<tool_response>\n{"temperature_c": 21}\n</tool_response><|im_end|>' in prompt


def test_a_template_that_only_says_the_word_tools_does_not_render_them() -> None:
    template = "{{ 'I have no tools.' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not tools.renders_tools(template)


def test_a_hermes_template_on_a_llama_tokenizer_is_hermes() -> None:
    """Hermes 3 is a Llama 3.1 fine-tune: its vocabulary has <|python_tag|>, its template
    teaches <tool_call>."""
    assert tools.tool_format(_template("qwen2.5"), _tokens("llama3")["special_tokens"]) is HERMES


def test_a_llama_template_without_markers_is_llama_by_its_header_tokens() -> None:
    assert tools.tool_format(_template("llama3.2_json"), []) is LLAMA


# -- rendering -------------------------------------------------------------------------------


def test_qwen25_renders_the_tools_a_call_and_its_result(tmp_path: Path) -> None:
    prompt = _shipped(tmp_path, "qwen2.5").render_chat(CONVERSATION, tools=[WEATHER])
    assert f"<tools>\n{json.dumps(WEATHER, ensure_ascii=False)}\n</tools>" in prompt
    call = '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert call + "<|im_end|>\n" in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature_c": 21}\n</tool_response><|im_end|>\n' in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", ["llama3.1_json", "llama3.2_json"])
def test_llama_renders_the_tools_a_call_and_its_result(tmp_path: Path, name: str) -> None:
    prompt = _shipped(tmp_path, name).render_chat(CONVERSATION, tools=[WEATHER])
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert json.dumps(WEATHER, indent=4) in prompt
    call = '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert call + "<|eot_id|>" in prompt
    result = json.dumps({"output": '{"temperature_c": 21}'})
    assert f"<|start_header_id|>ipython<|end_header_id|>\n\n{result}<|eot_id|>" in prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_mistral_renders_the_tools_a_call_and_its_result_with_nine_character_ids(tmp_path: Path) -> None:
    prompt = _shipped(tmp_path, "mistral_v0.3").render_chat(CONVERSATION, tools=[WEATHER])
    short = tools.mistral_call_id(CALL_ID)
    assert len(short) == 9 and short.isalnum()
    assert prompt.startswith('<s>[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"')
    assert f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {{"city": "Paris"}}, "id": "{short}"}}]</s>' in prompt
    assert f'[TOOL_RESULTS] {{"content": {{"temperature_c": 21}}, "call_id": "{short}"}}[/TOOL_RESULTS]' in prompt


# -- reading calls ---------------------------------------------------------------------------


def _hermes(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _llama(name: str, arguments: dict[str, Any]) -> str:
    return json.dumps({"name": name, "parameters": arguments})


def _mistral(*calls: tuple[str, dict[str, Any]]) -> str:
    return "[TOOL_CALLS] " + json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls])


# Each family's output: text then a call; two calls; a call to a function not offered; a
# call that the output ends inside.
TEXT_THEN_CALL = {
    HERMES: "Let me look.\n" + _hermes("get_weather", PARIS),
    LLAMA: "Let me look. <|python_tag|>" + _llama("get_weather", PARIS),
    MISTRAL: "Let me look. " + _mistral(("get_weather", PARIS)),
}
TWO_CALLS = {
    HERMES: _hermes("get_weather", PARIS) + "\n" + _hermes("get_time", UTC_ZONE),
    LLAMA: _llama("get_weather", PARIS) + "; " + _llama("get_time", UTC_ZONE),
    MISTRAL: _mistral(("get_weather", PARIS), ("get_time", UTC_ZONE)),
}
UNKNOWN = {
    HERMES: "Sure.\n" + _hermes("launch_rockets", {"count": 3}),
    LLAMA: _llama("launch_rockets", {"count": 3}),
    MISTRAL: _mistral(("launch_rockets", {"count": 3})),
}
UNFINISHED = {
    HERMES: "Sure.\n" + _hermes("get_weather", PARIS)[:-22],
    LLAMA: _llama("get_weather", PARIS)[:-8],
    MISTRAL: _mistral(("get_weather", PARIS))[:-8],
}
FAMILIES = [HERMES, LLAMA, MISTRAL]
PIECES = {"whole": 0, "1-char": 1}


def _stream(text: str, fmt: ToolFormat | None, size: int) -> tuple[str, list[ToolCall]]:
    """The text and the calls a StreamParser gives out for text fed in pieces of size (0:
    all at once)."""
    parser = StreamParser(fmt, OFFERED)
    items = []
    for start in range(0, len(text), size or len(text)):
        items += parser.feed(text[start : start + (size or len(text))])
    items += parser.finish()
    return "".join(i for i in items if isinstance(i, str)), [i for i in items if isinstance(i, ToolCall)]


def _weather() -> ToolCall:
    return ToolCall("get_weather", json.dumps(PARIS))


@pytest.mark.parametrize("pieces", PIECES)
@pytest.mark.parametrize("fmt", FAMILIES)
def test_text_before_a_call_is_text_and_the_call_a_call(fmt: ToolFormat, pieces: str) -> None:
    text = TEXT_THEN_CALL[fmt]
    streamed, calls = _stream(text, fmt, PIECES[pieces])
    assert calls == [_weather()] and streamed.strip() == "Let me look."
    assert tools.parse(text, fmt, OFFERED) == ("Let me look.", [_weather()])


@pytest.mark.parametrize("fmt", FAMILIES)
def test_text_before_a_call_goes_out_before_the_call_ends(fmt: ToolFormat) -> None:
    text = TEXT_THEN_CALL[fmt]
    parser = StreamParser(fmt, OFFERED)
    out = [item for char in text[:-3] for item in parser.feed(char)]
    assert "".join(str(item) for item in out).strip() == "Let me look."
    assert parser.feed(text[-3:]) + parser.finish() in ([_weather()], [_weather(), ""])


@pytest.mark.parametrize("pieces", PIECES)
@pytest.mark.parametrize("fmt", FAMILIES)
def test_several_calls_come_out_in_order(fmt: ToolFormat, pieces: str) -> None:
    streamed, calls = _stream(TWO_CALLS[fmt], fmt, PIECES[pieces])
    expected = [_weather(), ToolCall("get_time", json.dumps(UTC_ZONE))]
    assert calls == expected and streamed.strip() == ""
    assert tools.parse(TWO_CALLS[fmt], fmt, OFFERED) == ("", expected)


@pytest.mark.parametrize("pieces", PIECES)
@pytest.mark.parametrize("fmt", FAMILIES)
def test_a_call_to_a_function_not_offered_stays_text(fmt: ToolFormat, pieces: str) -> None:
    text = UNKNOWN[fmt]
    assert _stream(text, fmt, PIECES[pieces]) == (text, [])
    assert tools.parse(text, fmt, OFFERED) == (text, [])


@pytest.mark.parametrize("pieces", PIECES)
@pytest.mark.parametrize("fmt", FAMILIES)
def test_an_unfinished_call_at_the_end_stays_text(fmt: ToolFormat, pieces: str) -> None:
    text = UNFINISHED[fmt]
    assert _stream(text, fmt, PIECES[pieces]) == (text, [])
    assert tools.parse(text, fmt, OFFERED) == (text, [])


@pytest.mark.parametrize("pieces", PIECES)
@pytest.mark.parametrize("fmt", FAMILIES)
def test_plain_text_is_only_text(fmt: ToolFormat, pieces: str) -> None:
    text = "The weather in Paris is mild; take a coat [just in case] <b>today</b>."
    assert _stream(text, fmt, PIECES[pieces]) == (text, [])


@pytest.mark.parametrize(
    ("fmt", "marker"), [(HERMES, "<tool_call>"), (LLAMA, "<|python_tag|>"), (MISTRAL, "[TOOL_CALLS]")]
)
def test_text_that_may_begin_a_marker_is_held_until_it_cannot(fmt: ToolFormat, marker: str) -> None:
    parser = StreamParser(fmt, OFFERED)
    assert parser.feed("Say " + marker[:-2]) == ["Say "]
    assert parser.feed("!") == [marker[:-2] + "!"]


def test_a_hermes_call_goes_out_as_soon_as_its_block_closes() -> None:
    parser = StreamParser(HERMES, OFFERED)
    assert parser.feed(_hermes("get_weather", PARIS)) == [_weather()]


@pytest.mark.parametrize("pieces", PIECES)
def test_a_llama_message_that_starts_with_a_brace_is_held_until_the_end(pieces: str) -> None:
    parser = StreamParser(LLAMA, OFFERED)
    text = "  " + _llama("get_weather", PARIS)
    size = PIECES[pieces] or len(text)
    assert [item for start in range(0, len(text), size) for item in parser.feed(text[start : start + size])] == []
    assert parser.finish() == [_weather()]


def test_a_llama_json_answer_that_is_not_a_call_goes_out_once_its_first_key_says_so() -> None:
    parser = StreamParser(LLAMA, OFFERED)
    assert parser.feed('{"a') == []  # (may still become "arguments")
    assert parser.feed('nswer": 4') == ['{"answer": 4']
    assert parser.feed("2}") == ["2}"]
    assert parser.finish() == []


def test_a_mistral_call_list_without_its_marker_is_read() -> None:
    """[TOOL_CALLS] is a special token: a detokenizer that skips those leaves the list alone."""
    text = " " + json.dumps([{"name": "get_weather", "arguments": PARIS}])
    assert tools.parse(text, MISTRAL, OFFERED) == ("", [_weather()])


@pytest.mark.parametrize("fmt", FAMILIES)
def test_without_a_format_each_family_is_read(fmt: ToolFormat) -> None:
    assert tools.parse(TWO_CALLS[fmt], None, OFFERED)[1] == [_weather(), ToolCall("get_time", json.dumps(UTC_ZONE))]


def test_without_tools_any_function_name_is_a_call() -> None:
    assert tools.parse(UNKNOWN[HERMES], HERMES)[1] == [ToolCall("launch_rockets", '{"count": 3}')]


# -- forced calls ----------------------------------------------------------------------------

NESTED = _function(
    "book",
    {
        "guest": {"type": "object", "properties": {"name": {"type": "string"}}},
        "rooms": {"type": "array", "items": {"type": "object", "properties": {"beds": {"type": "integer"}}}},
        "pay": {"anyOf": [{"type": "object", "properties": {"card": {"type": "string"}}}, {"type": "null"}]},
        "address": {"$ref": "#/$defs/address"},
        "notes": {"type": "object", "additionalProperties": {"type": "string"}},
    },
)
NESTED["function"]["parameters"]["$defs"] = {"address": {"type": "object", "properties": {"city": {"type": "string"}}}}


def _objects(schema: Any) -> list[dict[str, Any]]:
    """Every object schema in a schema."""
    found = []
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            found.append(schema)
        for value in schema.values():
            found += _objects(value)
    elif isinstance(schema, list):
        for value in schema:
            found += _objects(value)
    return found


def test_forced_call_schema_closes_every_nested_object() -> None:
    arguments = tools.forced_call_schema([NESTED])["properties"]["arguments"]
    assert len(_objects(arguments)) == 6
    open_ones = [o for o in _objects(arguments) if o.get("additionalProperties") is not False]
    assert open_ones == [{"type": "object", "additionalProperties": {"type": "string"}}]


def test_forced_call_schema_leaves_the_offered_tools_as_they_were() -> None:
    before = json.dumps(NESTED)
    tools.forced_call_schema([NESTED])
    assert json.dumps(NESTED) == before


def test_forced_call_schema_leaves_objects_combined_from_parts_open() -> None:
    """additionalProperties sees only its own schema's properties: closing an allOf part, or
    the object that combines them, would refuse the other parts' properties."""
    combined = {
        "type": "object",
        "allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"b": {"type": "object"}}}],
    }
    closed = tools.closed_schema(combined)
    assert "additionalProperties" not in closed
    assert [("additionalProperties" in part) for part in closed["allOf"]] == [False, False]
    assert closed["allOf"][1]["properties"]["b"]["additionalProperties"] is False


def test_a_complete_forced_call_is_read_whole() -> None:
    text = json.dumps({"name": "get_weather", "arguments": PARIS})
    assert tools.parse_forced(text, [WEATHER]) == _weather()


def test_a_forced_call_cut_by_max_tokens_is_still_a_call() -> None:
    assert tools.parse_forced('{"name": "get_weather", "arguments": {"city": "Pa', [WEATHER]) == ToolCall(
        "get_weather", '{"city": "Pa'
    )


def test_a_forced_call_cut_in_its_name_takes_the_one_tool_offered() -> None:
    assert tools.parse_forced('{"na', [WEATHER]) == ToolCall("get_weather", "")


def test_a_forced_call_cut_among_several_tools_takes_the_name_it_began() -> None:
    assert tools.parse_forced('{"name": "get_ti', OFFERED) == ToolCall("get_time", "")
    assert tools.parse_forced('{"name": "get_time", "arguments": {"zo', OFFERED) == ToolCall("get_time", '{"zo')


def _record(text: str, finish: str) -> ResultRecord:
    outputs = {"text_output": text, "finish_reason": finish}
    return ResultRecord(
        request_id="r1", model="m", status=State.SUCCEEDED, outputs=outputs, created_at=datetime.now(UTC)
    )


def _required(stream: bool = False) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": CONVERSATION[:1], "tools": [WEATHER], "tool_choice": "required", "stream": stream}
    )


CUT = '{"name": "get_weather", "arguments": {"city": "Pa'


def test_a_cut_forced_call_answers_as_a_call_with_finish_reason_length() -> None:
    (choice,) = chat_completion([_record(CUT, "length")], _required())["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Pa'}
    ]


def test_a_streamed_cut_forced_call_comes_as_a_call_with_finish_reason_length() -> None:
    stream = ChunkStream(["r1"], _required(stream=True), 32)
    assert stream.on_token(0, "r1", CUT) == []
    chunks = [json.loads(event.data)["choices"][0] for event in stream.on_end(0, _record(CUT, "length"))]
    assert [c["delta"]["tool_calls"][0]["function"] for c in chunks[:-1]] == [
        {"name": "get_weather", "arguments": '{"city": "Pa'}
    ]
    assert chunks[-1]["finish_reason"] == "length"


def test_a_whole_forced_call_still_finishes_with_tool_calls() -> None:
    text = json.dumps({"name": "get_weather", "arguments": PARIS})
    (choice,) = chat_completion([_record(text, "stop")], _required())["choices"]
    assert choice["finish_reason"] == "tool_calls"


# -- the prompt's BOS ------------------------------------------------------------------------


def test_a_llama_chat_prompt_has_one_bos(tmp_path: Path) -> None:
    tokenizer = _shipped(tmp_path, "llama3.2_json")
    bos = tokenizer.tokenizer.token_to_id("<|begin_of_text|>")
    prompt = tokenizer.render_chat(CONVERSATION[:1])
    assert prompt.startswith("<|begin_of_text|>")
    ids = tokenizer.encode_prompt(prompt, chat=True)
    assert ids[0] == bos and ids.count(bos) == 1


def test_a_text_prompt_still_gets_the_tokenizers_bos(tmp_path: Path) -> None:
    tokenizer = _shipped(tmp_path, "llama3.2_json")
    bos = tokenizer.tokenizer.token_to_id("<|begin_of_text|>")
    assert tokenizer.encode_prompt("Once upon a time", chat=False)[0] == bos
