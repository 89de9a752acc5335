"""Text ↔ token ids with the model's ``tokenizer.json`` (the `tokenizers` library)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

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
    """Turns a growing list of ids into text deltas, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta


