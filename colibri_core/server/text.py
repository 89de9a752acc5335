"""Token ids → text deltas for streaming: UTF-8-safe decoding and `stop` strings that never show.

A stop string may arrive split over several tokens, so text that could still be the start of one
is held back until the next token settles it; the stop string itself and everything after it are
dropped, as the OpenAI API does.
"""
from __future__ import annotations

from ..tokenizer import StreamDecoder, Tokenizer


class StopMatcher:
    """Feed text pieces; get back the text safe to show, and whether a stop string was reached."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # text that may be the beginning of a stop string
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)  # longest tail that starts a stop string
        self.held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text, at the end of generation (it turned out not to be a stop string)."""
        held, self.held = self.held, ""
        return "" if self.stopped else held


class TextStream:
    """Token ids in, displayable text deltas out, honouring `stop` strings."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str]):
        self.decoder = StreamDecoder(tokenizer)
        self.matcher = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    def push(self, token: int) -> str:
        return self.matcher.push(self.decoder.push(token))

    def flush(self) -> str:
        """Whatever is still held: an incomplete UTF-8 sequence (as U+FFFD) and text held for `stop`."""
        d = self.decoder
        rest = d.tokenizer.decode(d.ids)[len(d.emitted):]
        d.emitted += rest
        return self.matcher.push(rest) + self.matcher.flush()
