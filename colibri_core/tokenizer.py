"""Text ↔ token ids with the model's ``tokenizer.json`` (the `tokenizers` library)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.decoders import DecodeStream

from .errors import ColibriError
from .fsio import TOKENIZER_BYTES, read_text


class Tokenizer:
    def __init__(self, path: str | Path):
        text = read_text(path, TOKENIZER_BYTES, fix="restore it from the model's original files or reconvert the model")
        try:
            self.tok = _HFTokenizer.from_str(text)
        except Exception as e:
            why = " ".join(str(e).split())[:200]
            raise ColibriError(f"{path}: not a readable tokenizer.json ({why}): restore it from the model's "
                               "original files or reconvert the model") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ColibriError(f"{model_dir}: no tokenizer.json: text prompts need one (the Python API takes token ids)")
        return cls(path)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


class StreamDecoder:
    """Token ids in, text deltas out: together what `decode` gives for all of them (special tokens
    skipped), at a cost per token that does not grow with the answer.

    tokenizers' `DecodeStream` decodes each new id with the ids of the piece before it as context
    (so a leading space, or a character split over byte-fallback tokens, comes out as in the whole)
    and holds ids back while their text ends in an incomplete UTF-8 character (U+FFFD); decoding the
    whole answer again on every token would make an answer's detokenisation quadratic."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)
        self.piece: list[int] = []  # the ids of the last text given out: the next one's context
        self.held: list[int] = []  # ids pushed since, whose text is not complete yet

    def push(self, token: int) -> str:
        try:
            text = self.stream.step(self.tokenizer.tok, token)
        except Exception as e:  # tokenizers raises a plain Exception (vLLM's detokenizer matches it the same way)
            if "Invalid prefix encountered" not in str(e):
                raise
            # The piece's text changed under the new token: bytes that made a character alone do not
            # with the bytes after them (decode shows each byte of such a run as U+FFFD). What was
            # given out stays out, the rest follows it, and the stream goes on from here.
            ids = [*self.piece, *self.held, token]
            text = self.tokenizer.decode(ids)[len(self.tokenizer.decode(self.piece)):]
            self.stream = DecodeStream([*self.held, token], skip_special_tokens=True)
        if text is None:
            self.held.append(token)
            return ""
        self.piece, self.held = [*self.held, token], []
        return text

    def flush(self) -> str:
        """The held ids' text, once the answer has ended: an incomplete UTF-8 character as U+FFFD."""
        ids, self.held = self.piece + self.held, []
        return self.tokenizer.decode(ids)[len(self.tokenizer.decode(self.piece)):]
