"""Text ↔ token ids with the model's ``tokenizer.json`` (the `tokenizers` library)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .errors import ColibriError


class Tokenizer:
    def __init__(self, path: str | Path):
        try:
            self.tok = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ColibriError(f"{path}: not a readable tokenizer.json ({e})") from e

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


def generation_defaults(model_dir: str | Path) -> dict:
    """``generation_config.json`` as a dict ({} if absent); ``eos_token_id`` normalised to a list."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ColibriError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e
    eos = cfg.get("eos_token_id")
    cfg["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return cfg
