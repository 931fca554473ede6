"""A streamed chat delta's frame, filled from a template rendered once per choice, is the
frame its dict would encode to: same keys in the same order, same escapes, LF line ends."""

from __future__ import annotations

import json

import pytest

from gateway.server.api.sse import FrameTemplate, encode
from gateway.server.openai.chat import ChunkStream, Pads
from gateway.server.openai.schemas import ChatCompletionRequest

TEXTS = [" hello", 'a "quote", a \\ backslash', "line\nbreak\ttab", "\u2028\u2029\x85 splitlines' ends", "é 😀 中", ""]


def _stream(**options: bool) -> ChunkStream:
    body = {"model": "llm", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    if options:
        body["stream_options"] = options
    return ChunkStream(["01JABCDEFGHJKMNPQRSTVWXYZ0"], ChatCompletionRequest.model_validate(body), 32)


def _dict_frame(stream: ChunkStream, text: str) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": None}
    return encode(stream._event(choice, text))


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
@pytest.mark.parametrize("options", [{}, {"include_usage": True, "include_obfuscation": False}])
def test_a_text_deltas_frame_is_the_frame_of_its_dict(text: str, options: dict[str, bool]) -> None:
    stream = _stream(**options)
    (frame,) = stream.on_token(0, "r", text)
    assert isinstance(frame, bytes)
    fast = json.loads(frame.removeprefix(b"data: "))
    slow = json.loads(_dict_frame(stream, text).removeprefix(b"data: "))
    if "obfuscation" in slow:  # random padding: only its length is the same
        assert len(fast.pop("obfuscation")) == len(slow.pop("obfuscation"))
    assert fast == slow and list(fast) == list(slow)
    assert frame.endswith(b"}\n\n") and frame.count(b"\n") == 2  # one data line
    assert "\u2028".encode() not in frame


def test_padding_brings_each_delta_to_a_multiple_of_16_and_differs() -> None:
    pads = Pads()
    taken = [pads.take(len(text)) for text in TEXTS * 200]  # past one pool
    assert all((len(text) + len(pad)) % 16 == 0 and pad for text, pad in zip(TEXTS * 200, taken, strict=True))
    assert len(set(taken)) > len(taken) // 2


def test_a_template_refuses_holes_out_of_order() -> None:
    with pytest.raises(ValueError, match="holes"):
        FrameTemplate({"a": FrameTemplate.hole(1), "b": FrameTemplate.hole(0)})
