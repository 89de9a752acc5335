"""Chat templates, rendered the way `transformers` renders them.

The template comes from ``chat_template.jinja`` or ``tokenizer_config.json["chat_template"]``;
it runs in an `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML, and the globals
``raise_exception`` and ``strftime_now``; it sees ``messages``, ``tools``,
``add_generation_prompt`` and the special tokens of ``tokenizer_config.json``.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ColibriError
from .fsio import TEMPLATE_BYTES, TOKENIZER_BYTES, read_json, read_text

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str], where: str = "chat template"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ColibriError(f"{where}: syntax error on line {e.lineno}: {e.message}") from None
        except RecursionError:
            raise ColibriError(f"{where}: nested too deeply to compile") from None
        self.special_tokens = special_tokens
        self.where = where

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model directory's chat template, or None if it has none."""
        model_dir = Path(model_dir)
        config, fix = {}, "restore it from the model's original files or reconvert the model"
        if (model_dir / "tokenizer_config.json").is_file():
            config = read_json(model_dir / "tokenizer_config.json", fix, limit=TOKENIZER_BYTES)
            if not isinstance(config, dict):
                raise ColibriError(f"{model_dir / 'tokenizer_config.json'} is not a JSON object: {fix}")
        special = {}
        for name in SPECIAL_TOKENS:
            tok = config.get(name)
            if isinstance(tok, dict):  # AddedToken serialised as a dict
                tok = tok.get("content")
            if isinstance(tok, str):
                special[name] = tok
        path = model_dir / "chat_template.jinja"
        if path.is_file():
            return cls(read_text(path, TEMPLATE_BYTES, "chat template", fix), special, str(path))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if source is not None and not isinstance(source, str):
            raise ColibriError(f"{model_dir / 'tokenizer_config.json'}: chat_template is not a template: {fix}")
        return cls(source, special, f"{model_dir / 'tokenizer_config.json'} chat_template") if source else None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None) -> str:
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except jinja2.TemplateError as e:
            raise ColibriError(f"{self.where}: {' '.join(str(e).split())}") from None
        except RecursionError:
            raise ColibriError(f"{self.where}: the template recursed too deeply") from None
