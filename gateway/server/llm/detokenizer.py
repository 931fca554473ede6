"""Incremental detokenization: token ids in as they are generated, text out only as whole
characters (HF tokenizers' DecodeStream, as vLLM and TGI do with a look-back window).
The pieces, joined, are exactly the text of all the tokens, for any Unicode: emoji,
CJK, combining marks; a character whose bytes span tokens comes out once complete."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""  # what has been emitted

    def prime(self, ids: list[int]) -> None:
        """Take tokens whose text was already emitted (a resumed stream)."""
        for token in ids:
            self.step(token)

    def step(self, token: int) -> str:
        """The new text this token completes ("" while a character is incomplete)."""
        self.ids.append(token)
        piece = self.stream.step(self.tokenizer, token) or ""
        self.text += piece
        return piece

    def finish(self) -> str:
        """What is left at the end (bytes of an unfinished character, as U+FFFD)."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        rest = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += rest
        return rest
