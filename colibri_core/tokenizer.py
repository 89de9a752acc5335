"""Text ↔ token ids with the model's ``tokenizer.json`` (the `tokenizers` library)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .errors import ColibriError
from .fsio import read_json


class Tokenizer:
    def __init__(self, path: str | Path):
        try:
            self.tok = _HFTokenizer.from_file(str(path))
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


def generation_defaults(model_dir: str | Path) -> dict:
    """``generation_config.json`` as a dict ({} if absent); ``eos_token_id`` normalised to a list."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    fix = "restore it from the model's original files or reconvert the model"
    cfg = read_json(path, fix)
    eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
    ok_id = lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
    if not isinstance(cfg, dict) or not (eos is None or ok_id(eos) or (isinstance(eos, list) and all(map(ok_id, eos)))):
        what = "not a JSON object" if not isinstance(cfg, dict) else f"eos_token_id {eos!r}"[:80] + " is not token ids"
        raise ColibriError(f"{path}: {what}: {fix}")
    cfg["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return cfg
