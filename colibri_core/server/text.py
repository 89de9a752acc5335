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
        return self.matcher.push(self.decoder.flush()) + self.matcher.flush()


class ChatText:
    """A conversation's token ids in which special tokens typed inside a message are text.

    The chat template's own special tokens (`<|user|>`, the EOS that ends a turn) must be tokens;
    the same strings typed by a user (`<|endoftext|>` pasted into a message) must stay text, or a
    message could end its own turn, or forge another role's. Each special token found in a
    message's content is replaced, before rendering, by a placeholder (private-use characters and a
    per-server nonce, which no template produces and no user can guess); the rendering is tokenized
    piece by piece between placeholders, and each placeholder becomes the token ids of its special
    token's text read literally. A conversation without typed special tokens is tokenized whole, as
    `transformers` tokenizes it.
    """

    def __init__(self, tokenizer: Tokenizer):
        import re
        import secrets

        self.tokenizer = tokenizer
        added = tokenizer.tok.get_added_tokens_decoder()
        self.specials = sorted({t.content for t in added.values() if t.special and t.content}, key=len, reverse=True)
        self.typed = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        nonce = secrets.token_hex(6)
        self.placeholder = f"\ue000{nonce}:{{}}\ue001"
        self.split = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        self._literal: dict[str, list[int]] = {}

    def mask(self, messages: list[dict]) -> list[dict]:
        """The messages with every special token typed in a content replaced by its placeholder."""
        if self.typed is None:
            return messages
        index = {s: i for i, s in enumerate(self.specials)}
        sub = lambda m: self.placeholder.format(index[m.group(0)])  # noqa: E731
        return [{**m, "content": self.typed.sub(sub, m["content"])} if isinstance(m.get("content"), str)
                and self.typed.search(m["content"]) else m for m in messages]

    def encode(self, rendered: str) -> list[int]:
        """Token ids of a rendering of masked messages (no BOS added: the template writes its own)."""
        pieces = self.split.split(rendered)
        if len(pieces) == 1:
            return self.tokenizer.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:  # a placeholder's index
                ids += self.literal(self.specials[int(piece)])
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids

    def literal(self, text: str) -> list[int]:
        """`text` tokenized as plain text, special tokens included (a copy of the tokenizer that
        does not recognise them, made once)."""
        if text not in self._literal:
            if not hasattr(self, "_plain"):
                from tokenizers import Tokenizer as Raw

                self._plain = Raw.from_str(self.tokenizer.tok.to_str())
                self._plain.encode_special_tokens = True
            self._literal[text] = self._plain.encode(text, add_special_tokens=False).ids
        return self._literal[text]
