"""Stop sequences as OpenAI defines them: matched on the generated text (not on token ids),
across token boundaries; the text returned ends before the first stop sequence, which is
left out.

Streamed text is held back while its end could be the beginning of a stop sequence, and
given out once it cannot (or at the end), so that a client never sees text that a stop
sequence later takes back."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.held = ""  # text not given out yet: its end may begin a stop sequence
        self.stopped = False
        self.matched: str | None = None  # the stop sequence that ended the text

    def feed(self, text: str) -> str:
        """New generated text in; the text that may be given out now. Once a stop sequence
        is found, `stopped` is set, the text before it is given out and the rest dropped."""
        if self.stopped:
            return ""
        self.held += text
        if not self.stops:
            out, self.held = self.held, ""
            return out
        found = [(at, stop) for stop in self.stops if (at := self.held.find(stop)) >= 0]
        if found:
            at, self.matched = min(found)
            out, self.held, self.stopped = self.held[:at], "", True
            return out
        if self._may_begin_stop(self.held):
            return ""
        out, self.held = self.held, ""
        return out

    def finish(self) -> str:
        """The text still held at the end (it began a stop sequence that never came)."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _may_begin_stop(self, text: str) -> bool:
        """Whether some end of `text` is the beginning of a stop sequence."""
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if stop.startswith(text[-size:]):
                    return True
        return False
