"""Tool calling (gateway/server/llm/tools.py), pure logic: calls read out of model text in
each family's format, the conversation shaped for a template, the format told from a
template, and forced-call schemas. (tests/test_tool_calls.py has the shipped templates and
the main cases of each family; these add the edges the module's docstrings promise.)"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest

from gateway.server.llm import tools
from gateway.server.llm.tools import StreamParser, ToolCall, ToolFormat

HERMES, LLAMA, MISTRAL = ToolFormat.HERMES, ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = _tool("get_weather", CITY)
TIME = _tool("get_time", {"type": "object", "properties": {"zone": {"type": "string"}}})
OFFERED = [WEATHER, TIME]


def _block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# -- reading calls: hermes -----------------------------------------------------------------


def test_hermes_arguments_given_as_a_json_string_are_kept_as_that_string() -> None:
    text = _block(json.dumps({"name": "get_weather", "arguments": '{"city": "Paris"}'}))
    assert tools.parse(text, HERMES, OFFERED) == ("", [ToolCall("get_weather", '{"city": "Paris"}')])


def test_a_hermes_call_without_arguments_has_an_empty_object() -> None:
    assert tools.parse(_block('{"name": "get_time"}'), HERMES, OFFERED) == ("", [ToolCall("get_time", "{}")])


def test_two_calls_in_one_hermes_block_are_both_read_in_order() -> None:
    body = '{"name": "get_time", "arguments": {}} {"name": "get_weather", "arguments": {"city": "Oslo"}}'
    _, calls = tools.parse(_block(body), HERMES, OFFERED)
    assert calls == [ToolCall("get_time", "{}"), ToolCall("get_weather", '{"city": "Oslo"}')]


def test_a_hermes_block_with_text_beside_its_call_keeps_the_text_and_reads_the_call() -> None:
    # (tests/test_tool_call_leftovers.py: stray text beside a call is the model's words)
    text, calls = tools.parse(_block('{"name": "get_time", "arguments": {}} and some words'), HERMES, OFFERED)
    assert calls == [ToolCall("get_time", "{}")]
    assert text.split() == ["and", "some", "words"]


def test_a_hermes_block_holding_json_that_is_not_a_call_is_text() -> None:
    for body in ("[1, 2]", '{"answer": 42}', '{"name": 7, "arguments": {}}', "not json"):
        assert tools.parse(_block(body), HERMES, OFFERED) == (_block(body), []), body


def test_json_nested_too_deeply_to_decode_is_text_not_an_error() -> None:
    text = _block("[" * 100_000)
    assert tools.parse(text, HERMES, OFFERED) == (text, [])


def test_text_on_both_sides_of_a_hermes_call_is_kept() -> None:
    text = "Checking. " + _block('{"name": "get_time", "arguments": {}}') + " Done."
    assert tools.parse(text, HERMES, OFFERED) == ("Checking.  Done.", [ToolCall("get_time", "{}")])


def test_a_hermes_marker_split_over_pieces_is_held_then_read_as_a_call() -> None:
    parser = StreamParser(HERMES, OFFERED)
    assert parser.feed("hello <tool_") == ["hello "]
    assert parser.feed('call>{"name": "get_time", "arguments": {}}</tool_') == []
    assert parser.feed("call> bye") == [ToolCall("get_time", "{}"), " bye"]
    assert parser.finish() == []
    assert parser.calls == [ToolCall("get_time", "{}")]


# -- reading calls: llama3_json and mistral ----------------------------------------------------


def test_llama_calls_separated_by_semicolons_are_all_read() -> None:
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert tools.parse(text, LLAMA, OFFERED) == (
        "",
        [ToolCall("get_time", "{}"), ToolCall("get_weather", '{"city": "Rome"}')],
    )


def test_a_mistral_list_with_one_call_not_offered_is_no_call_at_all() -> None:
    """A list is calls all or none."""
    text = '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]'
    assert tools.parse(text, MISTRAL, OFFERED) == (text, [])


def test_an_empty_mistral_list_is_text() -> None:
    assert tools.parse("[TOOL_CALLS] []", MISTRAL, OFFERED) == ("[TOOL_CALLS] []", [])


def test_a_message_that_starts_like_a_list_but_is_prose_comes_out_whole() -> None:
    """Without a format a message starting with "[" is held to the end, then read."""
    text = "[1] First point. [2] Second point."
    assert tools.parse(text, None, OFFERED) == (text, [])


def test_a_call_after_the_python_tag_is_read_and_text_before_it_kept() -> None:
    text = 'On it. <|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}'
    assert tools.parse(text, LLAMA, OFFERED) == ("On it.", [ToolCall("get_time", '{"zone": "UTC"}')])


# -- forced calls ------------------------------------------------------------------------------


def test_a_forced_call_with_white_space_around_it_is_read_whole() -> None:
    text = '  {"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert tools.parse_forced(text, OFFERED) == ToolCall("get_weather", '{"city": "Paris"}')


def test_an_empty_forced_output_with_one_tool_offered_is_a_call_to_it_without_arguments() -> None:
    assert tools.parse_forced("", [WEATHER]) == ToolCall("get_weather", "")


def test_a_forced_call_schema_for_a_named_tool_allows_only_that_tool() -> None:
    schema = tools.forced_call_schema(OFFERED, "get_time")
    jsonschema.validate({"name": "get_time", "arguments": {"zone": "UTC"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)


def test_a_forced_call_schema_for_any_tool_allows_each_and_nothing_else() -> None:
    schema = tools.forced_call_schema(OFFERED)
    jsonschema.validate({"name": "get_time", "arguments": {}}, schema)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Paris"}}, schema)
    for wrong in (
        {"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}},  # closed arguments
        {"name": "get_weather", "arguments": {}},  # its required argument
        {"name": "get_time", "arguments": {}, "why": "because"},  # the call object itself
        {"name": "rm_rf", "arguments": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_a_tool_without_parameters_is_forced_to_an_empty_arguments_object() -> None:
    schema = tools.forced_call_schema([_tool("ping")])
    jsonschema.validate({"name": "ping", "arguments": {}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "ping", "arguments": {"x": 1}}, schema)


def test_closed_schema_closes_an_object_typed_with_a_list_of_types() -> None:
    closed = tools.closed_schema({"type": ["object", "null"], "properties": {"a": {"type": "string"}}})
    assert closed["additionalProperties"] is False


def test_closed_schema_keeps_additional_and_unevaluated_properties_as_set() -> None:
    assert tools.closed_schema({"type": "object", "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in tools.closed_schema({"type": "object", "unevaluatedProperties": False})


def test_closed_schema_closes_the_options_of_an_any_of_that_stand_alone() -> None:
    schema = {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    assert [option["additionalProperties"] for option in tools.closed_schema(schema)["anyOf"]] == [False, False]


def test_closed_schema_accepts_what_an_object_combining_any_of_with_its_own_properties_accepts() -> None:
    schema = {
        "type": "object",
        "properties": {"kind": {"type": "string"}},
        "required": ["kind"],
        "anyOf": [
            {"properties": {"x": {"type": "integer"}}, "required": ["x"]},
            {"properties": {"y": {"type": "integer"}}, "required": ["y"]},
        ],
    }
    valid = {"kind": "point", "x": 1}
    jsonschema.validate(valid, schema)
    jsonschema.validate(valid, tools.closed_schema(schema))


def test_closed_schema_leaves_its_input_unchanged() -> None:
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {}}}}
    before = copy.deepcopy(schema)
    tools.closed_schema(schema)
    assert schema == before


# -- the conversation for a template -----------------------------------------------------------


def test_mistral_call_ids_of_nine_alphanumerics_are_kept_and_others_mapped_the_same_each_time() -> None:
    assert tools.mistral_call_id("abcDEF123") == "abcDEF123"
    mapped = tools.mistral_call_id("call_0123456789")
    assert len(mapped) == 9 and mapped.isalnum()
    assert tools.mistral_call_id("call_0123456789") == mapped != tools.mistral_call_id("call_0123456780")


def _conversation() -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    return [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
    ]


def test_for_template_gives_arguments_as_objects_and_none_content_as_empty() -> None:
    shaped = tools.for_template(_conversation())
    assert shaped[1]["content"] == ""
    assert shaped[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_for_template_leaves_arguments_that_are_not_json_as_they_are() -> None:
    messages = _conversation()
    messages[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    assert tools.for_template(messages)[1]["tool_calls"][0]["function"]["arguments"] == "{not json"


def test_for_template_for_mistral_maps_a_call_and_its_result_to_the_same_id() -> None:
    shaped = tools.for_template(_conversation(), MISTRAL)
    call_id = shaped[1]["tool_calls"][0]["id"]
    assert call_id == shaped[2]["tool_call_id"] == tools.mistral_call_id("call_1")


def test_for_template_leaves_the_messages_it_was_given_unchanged() -> None:
    messages = _conversation()
    before = copy.deepcopy(messages)
    tools.for_template(messages, MISTRAL)
    assert messages == before


def test_plain_messages_put_the_results_of_one_turn_in_one_user_message() -> None:
    messages = [
        *_conversation(),
        {"role": "tool", "tool_call_id": "call_2", "content": "windy"},
        {"role": "assistant", "content": "Cold and windy."},
    ]
    plain = tools.as_plain_messages(messages, None)
    assert [m["role"] for m in plain] == ["user", "assistant", "user", "assistant"]
    assert plain[2]["content"] == "<tool_response>\ncold\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in plain)


def test_plain_messages_write_an_assistants_calls_as_hermes_blocks_after_its_text() -> None:
    messages = _conversation()
    messages[1]["content"] = "Let me see."
    content = tools.as_plain_messages(messages, None)[1]["content"]
    assert content == 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert tools.parse(content, HERMES, OFFERED) == ("Let me see.", [ToolCall("get_weather", '{"city": "Oslo"}')])


def test_plain_messages_add_the_tool_prompt_to_the_system_message_there_is() -> None:
    plain = tools.as_plain_messages([{"role": "developer", "content": "Be brief."}, *_conversation()], OFFERED)
    assert plain[0]["role"] == "developer"
    assert plain[0]["content"] == "Be brief.\n\n" + tools.generic_tool_prompt(OFFERED)
    assert len(plain) == 4


def test_plain_messages_begin_with_the_tool_prompt_when_there_is_no_system_message() -> None:
    plain = tools.as_plain_messages(_conversation(), OFFERED)
    assert plain[0] == {"role": "system", "content": tools.generic_tool_prompt(OFFERED)}


# -- the format of a template ------------------------------------------------------------------


def test_a_model_without_a_template_is_hermes() -> None:
    assert tools.tool_format(None, {"<|python_tag|>"}) is HERMES


def test_a_template_that_cannot_be_parsed_does_not_render_tools() -> None:
    assert not tools.renders_tools("{% for tool in tools %}{{ tool }")


def test_a_marker_in_a_template_comment_does_not_decide_the_format() -> None:
    template = "{# we do not write <tool_call> here #}{{ tools }}<|start_header_id|>{{ messages }}"
    assert tools.tool_format(template, set()) is LLAMA


def test_a_tokenizers_special_tokens_decide_when_the_template_writes_no_marker() -> None:
    assert tools.tool_format("{{ tools }}{{ messages }}", {"[TOOL_CALLS]"}) is MISTRAL
    assert tools.tool_format("{{ tools }}{{ messages }}", {"<|eom_id|>"}) is LLAMA
