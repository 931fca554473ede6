"""Tool calling for chat models: tools in the prompt, tool calls out of the text.

Each family of chat templates has its own way of writing a call (a ToolFormat):

- hermes (NousResearch's Hermes 2 Pro and 3, Qwen2.5): each call is a JSON object between
  tags, anywhere in the text; a tool's result comes back between <tool_response> tags.

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

- llama3_json (Llama 3.1, 3.2 and 3.3 with JSON tool calling): the whole message is the call,
  {"name": "get_weather", "parameters": {"city": "Paris"}}, possibly after <|python_tag|>;
  some templates have several calls separated by ";".
- mistral (Mistral 7B v0.3, Nemo, Small): [TOOL_CALLS] and then a JSON list of
  {"name", "arguments"} objects.

A model's format (tool_format) comes from its chat template and its tokenizer's special
tokens: the call marker the template itself writes (<tool_call>, [TOOL_CALLS],
<|python_tag|>), else the one the tokenizer has as a token (<|python_tag|> and <|eom_id|>
are Llama 3.1's), else Llama 3's header tokens in the template. A template renders tools
when it reads the `tools` variable (renders_tools: Jinja's own analysis of the template,
not a substring test). Such a template gets the tool definitions and the messages as
transformers passes them (tool-call arguments as objects; for mistral, call ids of the 9
alphanumeric characters its templates demand). A template that does not (SmolLM2's,
ChatML) gets the conversation rewritten for it: a system message describing the tools in
the hermes format (generic_tool_prompt), assistant tool calls as <tool_call> blocks in the
assistant's text, tool results as a user turn of <tool_response> blocks; its output is
read as hermes.

Reading the output (parse, StreamParser): a call to a function that was not offered is not
a call (it stays text), nor is a block that is not valid JSON. Streamed, text that may begin
a call marker is held back until it cannot; a hermes call goes out whole once its block
closes (or at the end); after <|python_tag|> or [TOOL_CALLS] everything is held to the end.
The engine's detokenizer drops special tokens, and <|python_tag|> and [TOOL_CALLS] are
special in their tokenizers, so the markers are often not in the text at all: a llama3_json
message that starts with "{", or a mistral one that starts with "[", is held while it may be
a call (its first key one a call begins with: "name", "arguments", ...) and read at the end;
a JSON answer whose first key says it is not a call goes out as text at once. Stray text
beside a call inside its <tool_call> block is kept as text; a call whose arguments are not
an object (nor a string holding one) is not a call. Without a format (None) all three are read.

Why parsers of our own: the maintained parsers of these formats are vLLM's and SGLang's tool
parsers, which come with torch and transformers (the gateway deliberately imports neither);
mistral-common reads Mistral's format only, from token ids, and brings tiktoken, pillow and
requests; the small PyPI tool-call parsers are single releases without a maintained record.
Each format here is a few lines over json.JSONDecoder.raw_decode.

A forced call (tool_choice "required" or a named function) is made by guided decoding: the
whole output is then one bare call object, held to forced_call_schema, whose argument
schemas are closed as in OpenAI's strict mode. A forced call that max_tokens cut is still a
call (parse_forced): the name, and the arguments as far as they were written."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from jinja2 import Environment, TemplateError, meta
from jinja2.ext import loopcontrols


class ToolFormat(StrEnum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"


OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG, EOM = "<|python_tag|>", "<|eom_id|>"
TOOL_CALLS = "[TOOL_CALLS]"

# The tokens that tell the formats apart, in the order they decide.
_MARKERS: dict[ToolFormat, tuple[str, ...]] = {
    ToolFormat.HERMES: (OPEN,),
    ToolFormat.MISTRAL: (TOOL_CALLS,),
    ToolFormat.LLAMA3_JSON: (PYTHON_TAG, EOM),
}
# What a tokenizer is asked whether it has (LlmTokenizer).
MARKER_TOKENS: tuple[str, ...] = tuple(token for tokens in _MARKERS.values() for token in tokens)
_COMMENT = re.compile(r"\{#.*?#\}", re.DOTALL)
_PARSER = Environment(extensions=[loopcontrols])  # parses templates only, renders nothing


def renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (and so renders the tools itself)."""
    if not template:
        return False
    try:
        return "tools" in meta.find_undeclared_variables(_PARSER.parse(template))
    except TemplateError:
        return False


def tool_format(template: str | None, special_tokens: Collection[str]) -> ToolFormat:
    """The way a model writes tool calls, from its chat template and the special tokens of its
    tokenizer (see the module's docstring). A template that does not render tools gets the
    generic hermes prompt, so its model answers in hermes."""
    if not template or not renders_tools(template):
        return ToolFormat.HERMES
    source = _COMMENT.sub("", template)
    for fmt in (ToolFormat.HERMES, ToolFormat.MISTRAL, ToolFormat.LLAMA3_JSON):
        if any(marker in source for marker in _MARKERS[fmt]):
            return fmt
    for fmt in (ToolFormat.MISTRAL, ToolFormat.HERMES, ToolFormat.LLAMA3_JSON):
        if any(marker in special_tokens for marker in _MARKERS[fmt]):
            return fmt
    return ToolFormat.LLAMA3_JSON if "<|start_header_id|>" in source else ToolFormat.HERMES


def generic_tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that tells a model without a tool-aware template how to call (short:
    it is in every prompt of the conversation)."""
    described = "\n".join(json.dumps(tool, ensure_ascii=False, separators=(",", ":")) for tool in tools)
    return (
        f"You may call these functions:\n<tools>\n{described}\n</tools>\n"
        f'To call one, answer with\n{OPEN}\n{{"name": <name>, "arguments": <arguments object>}}\n{CLOSE}\n'
        "Results come back in <tool_response> tags."
    )


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object (OpenAI sends them as a JSON string)."""
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (ValueError, RecursionError):  # (RecursionError: nested too deeply)
            return arguments
    return arguments if arguments is not None else {}


def _call_block(call: dict[str, Any]) -> str:
    body = {"name": (call.get("function") or {}).get("name", ""), "arguments": _arguments(call)}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def mistral_call_id(call_id: str) -> str:
    """A call id as Mistral's templates take it: 9 alphanumeric characters (the same id
    always gives the same one, so a call and its result still match)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def for_template(messages: list[dict[str, Any]], fmt: ToolFormat = ToolFormat.HERMES) -> list[dict[str, Any]]:
    """Messages as a tool-aware template expects them (transformers' convention): assistant
    tool calls with their arguments as objects, None content as ""; for mistral, call ids
    of 9 alphanumeric characters."""
    shaped = []
    for message in messages:
        item = dict(message)
        if item.get("content") is None:
            item["content"] = ""
        if item.get("tool_calls"):
            item["tool_calls"] = [
                {**call, "function": {**(call.get("function") or {}), "arguments": _arguments(call)}}
                for call in item["tool_calls"]
            ]
        if fmt is ToolFormat.MISTRAL:
            for call in item.get("tool_calls") or []:
                if isinstance(call.get("id"), str):
                    call["id"] = mistral_call_id(call["id"])
            if isinstance(item.get("tool_call_id"), str):
                item["tool_call_id"] = mistral_call_id(item["tool_call_id"])
        shaped.append(item)
    return shaped


def as_plain_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template that knows only role and content: the tool prompt in
    the (first) system message, calls and results as text."""
    plain: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = "\n".join(_call_block(call) for call in message["tool_calls"])
            plain.append({"role": "assistant", "content": f"{content}\n{blocks}" if content else blocks})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if plain and plain[-1].get("tool_results"):  # results of one turn go together
                plain[-1]["content"] += "\n" + block
            else:
                plain.append({"role": "user", "content": block, "tool_results": True})
        else:
            plain.append({"role": role, "content": content})
    for item in plain:
        item.pop("tool_results", None)
    if tools:
        prompt = generic_tool_prompt(tools)
        if plain and plain[0]["role"] in ("system", "developer"):
            plain[0] = {"role": plain[0]["role"], "content": f"{plain[0]['content']}\n\n{prompt}"}
        else:
            plain.insert(0, {"role": "system", "content": prompt})
    return plain


# -- forced calls ----------------------------------------------------------------------------

_SUBSCHEMA = ("items", "additionalProperties")
_SUBSCHEMAS = ("anyOf", "oneOf", "prefixItems")
_NAMED_SUBSCHEMAS = ("properties", "$defs", "definitions", "patternProperties")


def _is_object(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    if isinstance(kind, list):
        return "object" in kind
    return kind == "object" or (kind is None and "properties" in schema)


def closed_schema(schema: Any, close: bool = True) -> Any:
    """The schema with every object schema that does not set additionalProperties closed
    (additionalProperties false), as OpenAI's strict mode does, through properties, items,
    anyOf, oneOf, allOf and $defs. An object that combines subschemas at its own level
    (allOf, anyOf, oneOf) is left open, and so are allOf's parts: additionalProperties sees
    only its own schema's properties, so closing either would refuse the others' properties.
    anyOf's and oneOf's options stand alone and are closed, unless the object beside them
    has properties of its own (closing an option would refuse those)."""
    if isinstance(schema, list):
        return [closed_schema(part) for part in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    own = "properties" in schema or "patternProperties" in schema
    for key, value in schema.items():
        if key in _NAMED_SUBSCHEMAS and isinstance(value, dict):
            out[key] = {name: closed_schema(part) for name, part in value.items()}
        elif isinstance(value, list) and (key == "allOf" or (key in ("anyOf", "oneOf") and own)):
            out[key] = [closed_schema(part, close=False) for part in value]
        elif key in _SUBSCHEMA or key in _SUBSCHEMAS:
            out[key] = closed_schema(value)
        else:
            out[key] = value
    combined = any(key in schema for key in ("allOf", "anyOf", "oneOf"))
    open_ended = "additionalProperties" in schema or "unevaluatedProperties" in schema
    if close and _is_object(schema) and not combined and not open_ended:
        out["additionalProperties"] = False
    return out


def forced_call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call object {"name", "arguments"} to one of the tools (or the
    named one): what guided decoding holds a forced call to. Its argument schemas are closed
    (closed_schema), or a model could add properties until max_tokens."""
    chosen = [t for t in tools if name is None or (t.get("function") or {}).get("name") == name]
    options = []
    for tool in chosen:
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function.get("name", "")}, "arguments": closed_schema(parameters)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


# -- reading calls -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it (as far as written, for a cut forced call)


_DECODER = json.JSONDecoder()
_SEPARATORS = " \t\r\n;,"


def _names(tools: list[dict[str, Any]] | None) -> list[str] | None:
    if tools is None:
        return None
    return [str((tool.get("function") or {}).get("name", "")) for tool in tools]


def _call_of(value: Any, names: Collection[str] | None) -> ToolCall | None:
    """A call object ({"name", "arguments"} or Llama's {"name", "parameters"}) to one of
    the functions named (any, for None). Its arguments are an object, or a string holding
    one (some models write them JSON-encoded); a call whose arguments are anything else (a
    string that is not JSON, a list, a number) is not a call: no client could run it."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if names is not None and value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            return None
        if not isinstance(decoded, dict):
            return None
        return ToolCall(value["name"], arguments if arguments.strip() else "{}")
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments))


def _calls_of(value: Any, names: Collection[str] | None) -> list[ToolCall] | None:
    """The calls in one JSON value: a call object, or a list of them (all or none)."""
    if isinstance(value, list):
        calls = [_call_of(item, names) for item in value]
        found = [call for call in calls if call is not None]
        return found if value and len(found) == len(calls) else None
    call = _call_of(value, names)
    return [call] if call is not None else None


def _read(text: str, names: Collection[str] | None) -> list[str | ToolCall]:
    """JSON values one after another (separated by white space, ";" or ","): each call
    object, or list of them, as calls; any other value, and what does not parse, as text."""
    items: list[str | ToolCall] = []
    position = 0
    while position < len(text):
        start = position
        while start < len(text) and text[start] in _SEPARATORS:
            start += 1
        if start == len(text):
            break  # separators at the end
        try:
            value, end = _DECODER.raw_decode(text, start)
        except (ValueError, RecursionError):
            items.append(text[position:])
            break
        calls = _calls_of(value, names)
        items.extend(calls if calls is not None else [text[position:end]])
        position = end
    return items


@dataclass(frozen=True)
class _Syntax:
    blocks: dict[str, str]  # opening tag -> closing tag: a call between them, anywhere
    markers: tuple[str, ...]  # all that follows one of these is calls
    bare: str  # a message that starts with one of these characters may be calls only

    @property
    def tags(self) -> tuple[str, ...]:
        return (*self.blocks, *self.markers)


_SYNTAX: dict[ToolFormat | None, _Syntax] = {
    ToolFormat.HERMES: _Syntax({OPEN: CLOSE}, (), ""),
    ToolFormat.LLAMA3_JSON: _Syntax({}, (PYTHON_TAG,), "{"),
    ToolFormat.MISTRAL: _Syntax({}, (TOOL_CALLS,), "["),
    None: _Syntax({OPEN: CLOSE}, (PYTHON_TAG, TOOL_CALLS), "{["),
}


class StreamParser:
    """Splits streamed text into plain text and tool calls as the pieces arrive (for one
    format, or all of them for None; only calls to the tools offered, or any for None)."""

    def __init__(self, fmt: ToolFormat | None = None, tools: list[dict[str, Any]] | None = None) -> None:
        self.syntax = _SYNTAX[fmt]
        self.names = _names(tools)
        self.buffer = ""
        self.state = "start"  # start (white space only so far), text, block or rest
        self.opened = ""  # the tag that began the block or the rest ("" for a bare message)
        self.calls: list[ToolCall] = []

    def feed(self, piece: str) -> list[str | ToolCall]:
        self.buffer += piece
        out: list[str | ToolCall] = []
        while True:
            if self.state == "start":
                begun = self.buffer.lstrip()
                if not begun or any(tag.startswith(begun) and tag != begun for tag in self.syntax.tags):
                    return out  # nothing yet, or perhaps a marker
                bare = begun[0] in self.syntax.bare and not begun.startswith(self.syntax.tags)
                self.state = "rest" if bare else "text"
            elif self.state == "rest":
                if self.opened or _may_be_call(self.buffer):
                    return out
                self.state = "text"  # a bare message that cannot be a call: text, from now on
            elif self.state == "block":
                close = self.syntax.blocks[self.opened]
                end = self.buffer.find(close)
                if end < 0:
                    return out
                out += self._block(self.buffer[:end], self.opened + self.buffer[: end + len(close)])
                self.buffer = self.buffer[end + len(close) :]
                self.state = "text"
            else:
                found = [(at, tag) for tag in self.syntax.tags if (at := self.buffer.find(tag)) >= 0]
                if not found:
                    keep = _partial_tag(self.buffer, self.syntax.tags)
                    text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                    if text:
                        out.append(text)
                    return out
                at, tag = min(found)
                if at:
                    out.append(self.buffer[:at])
                self.buffer = self.buffer[at + len(tag) :]
                self.opened = tag
                self.state = "block" if tag in self.syntax.blocks else "rest"

    def finish(self) -> list[str | ToolCall]:
        rest, self.buffer = self.buffer, ""
        state, self.state = self.state, "text"
        if state == "block":
            return self._block(rest, self.opened + rest)
        if state == "rest":
            items = _read(rest, self.names)
            if not any(isinstance(item, ToolCall) for item in items):
                return [self.opened + rest]
            return self._took(items)
        return [rest] if rest else []

    def _block(self, body: str, raw: str) -> list[str | ToolCall]:
        items = _read(body, self.names)
        start = body.find("{")
        if not any(isinstance(item, ToolCall) for item in items) and start > 0:
            items = [body[:start], *_read(body[start:], self.names)]  # (text before the call object)
        if not any(isinstance(item, ToolCall) for item in items):
            return [raw]  # not a call after all: it was text
        # (stray text beside the call inside its block, as small models write: kept as text)
        return self._took([item for item in items if not isinstance(item, str) or item.strip()])

    def _took(self, items: list[str | ToolCall]) -> list[str | ToolCall]:
        self.calls += [item for item in items if isinstance(item, ToolCall)]
        return items


# The keys a call object begins with (hermes' and mistral's "name", "arguments"; Llama's
# "name", "parameters"; some templates write "type": "function" first).
_CALL_KEYS = ("name", "arguments", "parameters", "type", "function")
_FIRST_KEY = re.compile(r'\s*("((?:[^"\\]|\\.)*)(")?)?')


def _may_be_call(text: str) -> bool:
    """Whether a bare message ("{" or "[" first) may still be a call: held back only so
    long as its first key is, or may become, one a call object begins with; a JSON answer
    that is not a call ({"answer": ...}) goes out as text as soon as its first key says so."""
    body = text.lstrip()
    if body.startswith("["):
        body = body[1:].lstrip()
        if not body:
            return True
    if not body.startswith("{"):
        return False
    found = _FIRST_KEY.match(body, 1)
    assert found is not None  # (every part of the pattern is optional)
    if found.end() == len(body) and found.group(2) is None:
        return True  # nothing after the brace yet but white space (or a quote)
    if found.group(1) is None:
        return False  # something other than a key after the brace
    key = found.group(2)
    if found.group(3):  # the key is whole
        return key in _CALL_KEYS
    return any(name.startswith(key) for name in _CALL_KEYS)


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin one of the tags."""
    longest = max((len(tag) for tag in tags), default=1)
    for size in range(min(longest - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-size:]) for tag in tags):
            return size
    return 0


def parse(
    text: str, fmt: ToolFormat | None = None, tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[ToolCall]]:
    """The text outside the calls, and the calls (to the tools offered; any, for None), as
    StreamParser reads them; the text unchanged when there is none."""
    parser = StreamParser(fmt, tools)
    items = [*parser.feed(text), *parser.finish()]
    calls = [item for item in items if isinstance(item, ToolCall)]
    if not calls:
        return text, []
    return "".join(item for item in items if isinstance(item, str)).strip(), calls


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def parse_forced(text: str, tools: list[dict[str, Any]] | None = None) -> ToolCall:
    """A forced call's output: one bare call object. One that max_tokens cut (not valid JSON)
    is still the call: its name that of the only tool offered, else the one the text names
    (or begins to), its arguments the text as far as it was written."""
    body = text.strip()
    try:
        value, _ = _DECODER.raw_decode(body)
    except (ValueError, RecursionError):
        value = None
    call = _call_of(value, None)
    if call is not None:
        return call
    names = _names(tools) or []
    arguments = _ARGUMENTS.search(body)
    return ToolCall(_cut_name(body, names), body[arguments.end() :] if arguments else "")


def _cut_name(body: str, names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    found = _NAME.search(body)
    if found is None:
        return ""
    written = found.group(1)
    if found.group(2):  # the name is whole
        return written
    matching = [name for name in names if name.startswith(written)]
    return matching[0] if len(matching) == 1 else written
