"""An event's frame (gateway/server/api/sse.py encode) reads back whole in a client that
splits lines as Python does (httpx's aiter_lines)."""

from __future__ import annotations

import json

from sse_starlette import ServerSentEvent

from gateway.server.api.sse import encode


def test_a_token_of_a_unicode_line_separator_stays_on_its_data_line() -> None:
    token = {"count": 3, "index": 144, "text_output": "a\u2028b\u2029c\x85d"}
    frame = encode(ServerSentEvent(data=json.dumps(token, ensure_ascii=False), event="token", id="1-0"))
    identity, kind, data, end = frame.decode().splitlines()  # the event's three lines, then the blank one
    assert (identity, kind, end) == ("id: 1-0", "event: token", "")
    assert json.loads(data.removeprefix("data: ")) == token
