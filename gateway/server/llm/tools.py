"""Tool calling for chat models: tools in the prompt, tool calls out of the text.

The format is the Hermes one (NousResearch's Hermes 2 Pro, also Qwen2.5's): the model writes
each call as a JSON object on its own between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and a tool's result comes back to it between <tool_response> tags.

A chat template that knows tools (it uses the `tools` variable) renders them itself, from
the tool definitions and the messages as transformers passes them (tool-call arguments as
objects). A template that does not (SmolLM2's, ChatML) gets the conversation rewritten for
it: a system message describing the tools in the format above (generic_tool_prompt),
assistant tool calls as <tool_call> blocks in the assistant's text, and tool results as a
user turn of <tool_response> blocks.

A forced call (tool_choice "required" or a named function) is made by guided decoding: the
whole output is then one bare call object, constrained by forced_call_schema."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in (template or "")


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
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


def _call_block(call: dict[str, Any]) -> str:
    body = {"name": (call.get("function") or {}).get("name", ""), "arguments": _arguments(call)}
    return f"{OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CLOSE}"


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a tool-aware template expects them (transformers' convention): assistant
    tool calls with their arguments as objects, None content as ""."""
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


def forced_call_schema(tools: list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call object {"name", "arguments"} to one of the tools (or the
    named one): what guided decoding holds a forced call to."""
    chosen = [t for t in tools if name is None or (t.get("function") or {}).get("name") == name]
    options = []
    for tool in chosen:
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function.get("name", "")}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it


def _call_of(text: str) -> ToolCall | None:
    try:
        body = json.loads(text)
    except ValueError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    return ToolCall(body["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def parse_forced(text: str) -> ToolCall | None:
    """A forced call's output: one bare call object."""
    return _call_of(text.strip())


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside <tool_call> blocks, and the calls in them (a block that is not a
    valid call stays in the text)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        call = _call_of(match.group(1))
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    return "".join(kept).strip() if calls else text, calls


class StreamParser:
    """Splits streamed text into plain text and tool calls as the pieces arrive: text that
    may be the start of a <tool_call> tag is held back until it is not; a call is given out
    whole once its block closes (or at the end)."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, piece: str) -> list[str | ToolCall]:
        self.buffer += piece
        out: list[str | ToolCall] = []
        while True:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return out
                out.extend(self._close(self.buffer[:end], OPEN + self.buffer[: end + len(CLOSE)]))
                self.buffer = self.buffer[end + len(CLOSE) :]
                self.in_call = False
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                if start:
                    out.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(OPEN) :]
                self.in_call = True
                continue
            keep = _partial_tag(self.buffer)
            text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
            if text:
                out.append(text)
            return out

    def finish(self) -> list[str | ToolCall]:
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            return self._close(rest, OPEN + rest)
        return [rest] if rest else []

    def _close(self, body: str, raw: str) -> list[str | ToolCall]:
        call = _call_of(body.strip())
        if call is None:
            return [raw]  # not a call after all: it was text
        self.calls.append(call)
        return [call]


def _partial_tag(text: str) -> int:
    """How many characters at the end of text could begin <tool_call>."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
