"""OpenAI request bodies as declared models: each model both checks a body field by field and
describes itself as JSON Schema, so the OpenAPI document the server publishes (openapi.py) is
generated from the very objects the handlers validate with; nothing is described twice.

Anything wrong is an `ApiError` (a 4xx with the OpenAI error body), never a 500. What is accepted
follows the OpenAI API and its common local extensions (vLLM's `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`; llama-server's `repeat_penalty`, `repeat_last_n`, `grammar`);
knobs the engine does not implement (several choices, llama-server's mirostat, DRY, XTC, …) are
accepted only at their neutral value and refused otherwise, and a field the generation models do
not declare is a 400 naming it (`Obj(closed=True)`), so a client never silently gets something
other than what it asked for. Every optional field may be null, which means "the default".

Bounds (`Limits`, most of them also in the published schema): the body's bytes and JSON nesting,
characters of text, messages per conversation, stop strings and their length, token ids per
prompt, `max_tokens` (the context, or the operator's `--max-tokens`), `n` = 1.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 512  # characters per stop string
MAX_DEPTH = 32  # nesting of arrays and objects in a request body
MAX_MESSAGES = 4096
MAX_TOOLS = 128  # OpenAI's own limit
MAX_NAME = 512  # characters of a model id, a message's name, a tool call id
MAX_FUNCTION_NAME = 64  # OpenAI's limit on a function's name
CHARS_PER_TOKEN = 32  # text beyond this many characters per token of context is refused untokenized
MAX_LOGPROBS = 20  # most likely tokens listed with each token's log-probability (vLLM's default bound)
MAX_BIAS = 100  # |logit_bias| (OpenAI's bound)
# what to send instead of a field the generation models do not know
HINTS = {
    "functions": "use 'tools'", "function_call": "use 'tool_choice'",
    "n_probs": "use 'logprobs' (and 'top_logprobs' on chat)", "n_predict": "use 'max_tokens'",
    "json_schema": "use 'response_format' {\"type\": \"json_schema\", ...}",
    "penalize_nl": "colibri's penalties count every token, newlines too",
}


class ApiError(Exception):
    """An HTTP error with the OpenAI body {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Limits:
    """What one server accepts; the parts known only once the model is loaded are None before."""

    context: int | None = None  # the model's context length, in tokens
    vocab: int | None = None  # token ids are in [0, vocab)
    max_tokens: int | None = None  # the operator's cap on tokens generated per request (None: the context)
    max_body_bytes: int = 16 << 20

    @property
    def tokens_cap(self) -> int | None:
        caps = [c for c in (self.context, self.max_tokens) if c is not None]
        return min(caps) if caps else None

    @property
    def max_chars(self) -> int:
        """Characters of text one request may carry: CHARS_PER_TOKEN per token of context (text
        that long cannot fit, and tokenizing it would only cost time and memory)."""
        return CHARS_PER_TOKEN * self.context if self.context else self.max_body_bytes

    @property
    def max_token_ids(self) -> int:
        return self.context or (1 << 17)


# ---- parsing the body: JSON, bounded ----------------------------------------------------------
def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object: strict JSON (no NaN or Infinity), nested at most
    MAX_DEPTH deep, every string valid Unicode (no lone surrogates)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep",
                       code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, NaN, a number of more than 4300 digits
        raise ApiError(400, f"the request body is not valid JSON ({getattr(e, 'msg', e)})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {_kind(body)}", code="invalid_json")
    check_tree(body)
    return body


def check_tree(body) -> None:
    """Depth and Unicode of a whole parsed body, without recursion."""
    stack = [(body, 1, "")]
    while stack:
        v, depth, where = stack.pop()
        if isinstance(v, str):
            _check_unicode(v, where)
        elif isinstance(v, (dict, list)):
            if depth > MAX_DEPTH:
                raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep",
                               code="invalid_json", param=where or None)
            if isinstance(v, dict):
                for k, child in v.items():
                    path = f"{where}.{k}" if where else k
                    _check_unicode(k, path)
                    stack.append((child, depth + 1, path))
            else:
                stack += [(child, depth + 1, f"{where}[{i}]") for i, child in enumerate(v)]


def _check_unicode(s: str, where: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = where.encode("utf-8", "backslashreplace").decode()  # a key may hold the surrogate itself
        raise invalid(where or None, f"'{where}' is not valid Unicode: a lone surrogate "
                      f"U+{ord(s[e.start]):04X} at character {e.start}", "invalid_unicode") from None


def _kind(v) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _json_kind(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "null")


# ---- the declared models: check a value, describe it as JSON Schema -----------------------------
class Spec:
    """One field's type: `check(value, param)` returns the value to use (value is never None);
    `schema()` is its JSON Schema (OpenAPI 3.1 dialect)."""

    kinds: tuple[str, ...] = ()  # the JSON kinds it may take ("integer" values are "number"s too)

    def __init__(self, description: str = ""):
        self.description = description

    def check(self, v, param: str):
        raise NotImplementedError

    def schema(self) -> dict:
        raise NotImplementedError

    def doc(self) -> dict:
        s = self.schema()
        return {**s, "description": self.description} if self.description else s

    def accepts_kind(self, v) -> bool:
        k = _json_kind(v)
        return k in self.kinds or (k == "integer" and "number" in self.kinds)


class Integer(Spec):
    kinds = ("integer",)

    def __init__(self, low: int | None = None, high: int | None = None, description: str = ""):
        super().__init__(description)
        self.low, self.high = low, high

    def check(self, v, param):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise invalid(param, f"'{param}' must be an integer, not {_kind(v)}", "invalid_type")
        if self.low is not None and v < self.low:
            raise invalid(param, f"'{param}' must be at least {self.low}, got {v}")
        if self.high is not None and v > self.high:
            raise invalid(param, f"'{param}' must be at most {self.high}, got {v}")
        return v

    def schema(self):
        s = {"type": "integer"}
        if self.low is not None:
            s["minimum"] = self.low
        if self.high is not None:
            s["maximum"] = self.high
        return s


class Number(Spec):
    kinds = ("number",)

    def __init__(self, low: float, high: float, low_open: bool = False, description: str = ""):
        super().__init__(description)
        self.low, self.high, self.low_open = low, high, low_open

    def check(self, v, param):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise invalid(param, f"'{param}' must be a number, not {_kind(v)}", "invalid_type")
        interval = f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}]"
        if not math.isfinite(v) or v < self.low or (self.low_open and v == self.low) or v > self.high:
            raise invalid(param, f"'{param}' must be a finite number in {interval}, got {v}")
        return float(v)

    def schema(self):
        s = {"type": "number", "exclusiveMinimum" if self.low_open else "minimum": self.low, "maximum": self.high}
        return s


class Boolean(Spec):
    kinds = ("boolean",)

    def check(self, v, param):
        if not isinstance(v, bool):
            raise invalid(param, f"'{param}' must be a boolean, not {_kind(v)}", "invalid_type")
        return v

    def schema(self):
        return {"type": "boolean"}


class String(Spec):
    kinds = ("string",)

    def __init__(self, max_length: int | None = None, min_length: int = 0, choices: tuple[str, ...] | None = None,
                 description: str = "", refusal: str | None = None):
        super().__init__(description)
        self.max_length, self.min_length, self.choices, self.refusal = max_length, min_length, choices, refusal

    def check(self, v, param):
        if not isinstance(v, str):
            raise invalid(param, f"'{param}' must be a string, not {_kind(v)}", "invalid_type")
        if self.choices is not None and v not in self.choices:
            if self.refusal:  # a value OpenAI knows but colibri does not do
                raise invalid(param, f"'{param}' may be {' or '.join(map(repr, self.choices))}: {self.refusal}",
                              "unsupported_parameter")
            raise invalid(param, f"'{param}' must be one of {', '.join(self.choices)}, got {v!r}")
        if len(v) < self.min_length:
            raise invalid(param, f"'{param}' must not be empty" if self.min_length == 1
                          else f"'{param}' must hold at least {self.min_length} characters")
        if self.max_length is not None and len(v) > self.max_length:
            raise invalid(param, f"'{param}' holds {len(v)} characters; at most {self.max_length} are accepted",
                          "string_too_long")
        return v

    def schema(self):
        s = {"type": "string"}
        if self.choices is not None:
            s["enum"] = list(self.choices)
        if self.min_length:
            s["minLength"] = self.min_length
        if self.max_length is not None:
            s["maxLength"] = self.max_length
        return s


class Neutral(Spec):
    """A knob colibri does not implement: accepted only at its neutral value."""

    def __init__(self, value, what: str, description: str = ""):
        super().__init__(description or f"Not supported: accepted only as {json.dumps(value)} ({what}).")
        self.value, self.what = value, what
        self.kinds = (_json_kind(value) if not isinstance(value, dict) else "object",)

    def check(self, v, param):
        same = (v == {} if isinstance(self.value, dict) else
                isinstance(v, bool) == isinstance(self.value, bool) and type(v) in (int, float, bool, str)
                and type(self.value) in (int, float, bool, str) and v == self.value)
        if not same:
            raise invalid(param, f"'{param}' is not supported by colibri ({self.what})", "unsupported_parameter")
        return v

    def schema(self):
        return {"type": "object", "maxProperties": 0} if isinstance(self.value, dict) else {"const": self.value}


class Array(Spec):
    kinds = ("array",)

    def __init__(self, items: Spec, min_items: int = 0, max_items: int | None = None, description: str = ""):
        super().__init__(description)
        self.items, self.min_items, self.max_items = items, min_items, max_items

    def check(self, v, param):
        if not isinstance(v, list):
            raise invalid(param, f"'{param}' must be an array, not {_kind(v)}", "invalid_type")
        if len(v) < self.min_items:
            raise invalid(param, f"'{param}' must not be empty" if self.min_items == 1
                          else f"'{param}' must hold at least {self.min_items} items")
        if self.max_items is not None and len(v) > self.max_items:
            raise invalid(param, f"'{param}' holds {len(v)} items; at most {self.max_items} are accepted",
                          "array_too_long")
        out = []
        for i, item in enumerate(v):
            if item is None:
                raise invalid(f"{param}[{i}]", f"'{param}[{i}]' must not be null", "invalid_type")
            out.append(self.items.check(item, f"{param}[{i}]"))
        return out

    def schema(self):
        s = {"type": "array", "items": self.items.doc()}
        if self.min_items:
            s["minItems"] = self.min_items
        if self.max_items is not None:
            s["maxItems"] = self.max_items
        return s


class AnyJson(Spec):
    """Free-form JSON of one kind (tool definitions, tool calls): only its kind is checked."""

    def __init__(self, kind: str = "object", description: str = ""):
        super().__init__(description)
        self.kinds = (kind,)

    def check(self, v, param):
        if not self.accepts_kind(v):
            raise invalid(param, f"'{param}' must be {'an' if self.kinds[0][0] in 'aeiou' else 'a'} {self.kinds[0]}, "
                          f"not {_kind(v)}", "invalid_type")
        return v

    def schema(self):
        return {"type": self.kinds[0]}


def nullable(schema: dict) -> dict:
    t = schema.get("type")
    if isinstance(t, str) and "enum" not in schema:
        return {**schema, "type": [t, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


class Obj(Spec):
    """A JSON object with declared fields (checked; absent or null: None) and, unless `closed`, any
    others (kept, ignored); closed, another field is a 400 naming it (with a hint from HINTS)."""

    kinds = ("object",)

    def __init__(self, fields: dict[str, Spec], required: tuple[str, ...] = (), description: str = "",
                 rules: list[dict] | None = None, closed: bool = False):
        super().__init__(description)
        self.fields, self.required, self.closed = fields, required, closed
        self.rules = rules or []  # extra JSON Schema (anyOf alternatives) that the caller's code also enforces

    def check(self, v, param):
        if not isinstance(v, dict):
            raise invalid(param or None, f"'{param}' must be an object, not {_kind(v)}" if param
                          else f"the request body must be a JSON object, not {_kind(v)}", "invalid_type")
        unknown = next((k for k in v if k not in self.fields), None) if self.closed else None
        if unknown is not None:
            where = f"{param}.{unknown}" if param else unknown
            hint = HINTS.get(unknown, "colibri does not support it")
            raise invalid(where, f"'{where}' is not a field colibri knows: {hint}", "unsupported_parameter")
        out = {}
        for name, spec in self.fields.items():
            where = f"{param}.{name}" if param else name
            value = v.get(name)
            if value is None:
                if name in self.required:
                    raise invalid(where, f"'{where}' is required", "missing_required_parameter")
                out[name] = None
            else:
                out[name] = spec.check(value, where)
        return out

    def schema(self):
        props = {name: (spec.doc() if name in self.required else nullable(spec.doc()))
                 for name, spec in self.fields.items()}
        s = {"type": "object", "properties": props}
        if self.closed:
            s["additionalProperties"] = False
        if self.required:
            s["required"] = list(self.required)
        for rule in self.rules:
            s.setdefault("allOf", []).append(rule)
        return s


class OneOfKinds(Spec):
    """A value of one of several kinds, each with its own spec (the first that takes its kind)."""

    def __init__(self, *options: Spec, description: str = ""):
        super().__init__(description)
        self.options = options
        self.kinds = tuple(k for o in options for k in o.kinds)

    def check(self, v, param):
        for o in self.options:
            if o.accepts_kind(v):
                return o.check(v, param)
        names = " or ".join(dict.fromkeys({"string": "a string", "array": "an array", "object": "an object",
                                           "integer": "an integer", "number": "a number", "boolean": "a boolean"}[k]
                                          for k in self.kinds))
        raise invalid(param, f"'{param}' must be {names}, not {_kind(v)}", "invalid_type")

    def schema(self):
        return {"anyOf": [o.doc() for o in self.options]}


# ---- the pieces of the models -----------------------------------------------------------------------
class LogitBias(Spec):
    """OpenAI's logit_bias: {"token id": a bias from -100 to 100 added to its logit}; -100 bans, 100
    forces (in effect). Returned as {int: float}."""

    kinds = ("object",)

    def __init__(self, lim: Limits):
        super().__init__("Token id (a string) → bias from -100 to 100 added to the token's logit before sampling.")
        self.high = lim.vocab - 1 if lim.vocab else None
        self.bias = Number(-MAX_BIAS, MAX_BIAS)

    def check(self, v, param):
        if not isinstance(v, dict):
            raise invalid(param, f"'{param}' must be an object mapping token ids to biases, not {_kind(v)}",
                          "invalid_type")
        out = {}
        for key, bias in v.items():
            token = int(key) if key.isascii() and key.isdigit() else None
            if token is None or (self.high is not None and token > self.high):
                raise invalid(param, f"'{param}' names {key!r}, not a token id of this model's vocabulary "
                              f"(0 … {self.high})" if self.high is not None else f"'{param}' names {key!r}, not a "
                              "token id")
            out[token] = self.bias.check(bias, f"{param}.{key}")
        return out

    def schema(self):
        return {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                "additionalProperties": self.bias.schema()}


class TokenIds(Array):
    """Token ids of this model's vocabulary; a wrong one is named with the array's param."""

    def __init__(self, lim: Limits, min_items: int = 1, description: str = "Token ids of this model's vocabulary."):
        high = lim.vocab - 1 if lim.vocab else None
        super().__init__(Integer(0, high), min_items, lim.max_token_ids, description)

    def check(self, v, param):
        if isinstance(v, list) and all(_json_kind(t) == "integer" for t in v):
            v = [int(t) for t in v]  # 5.0 is the integer 5 in JSON Schema
            hi = self.items.high
            bad = next((t for t in v if t < 0 or (hi is not None and t > hi)), None)
            if bad is not None:
                raise invalid(param, f"token id {bad} is outside this model's vocabulary (0 … {hi})")
        return super().check(v, param)


class TextPart(Obj):
    def __init__(self, lim: Limits):
        super().__init__({"type": String(choices=("text",), description="Only text: this model reads text."),
                          "text": String(lim.max_chars)}, required=("type", "text"))

    def check(self, v, param):
        if isinstance(v, dict) and isinstance(v.get("type"), str) and v["type"] != "text":
            raise invalid(param, f"'{param}' is a part of type {v['type']!r}; this model takes text only",
                          "unsupported_content")
        return super().check(v, param)["text"]


def content_spec(lim: Limits) -> Spec:
    return OneOfKinds(String(lim.max_chars), Array(TextPart(lim), max_items=MAX_MESSAGES),
                      description="The message's text, or an array of text parts (joined).")


class Message(Spec):
    """A chat message: a role, and content (which an assistant message may leave out, as when it
    only calls tools); other fields (`name`, `tool_calls`, `tool_call_id`, …) go to the template."""

    kinds = ("object",)

    def __init__(self, lim: Limits):
        super().__init__()
        self.content = content_spec(lim)
        self.fields = {"name": String(MAX_NAME), "tool_calls": Array(AnyJson("object"), max_items=MAX_TOOLS),
                       "tool_call_id": String(MAX_NAME)}

    def check(self, m, param):
        if not isinstance(m, dict):
            raise invalid(param, f"'{param}' must be an object, not {_kind(m)}", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{param}.role", f"'{param}.role' must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None and role != "assistant":
            raise invalid(f"{param}.content", f"'{param}.content' is required", "missing_required_parameter")
        Obj(self.fields).check(m, param)
        text = "" if content is None else self.content.check(content, f"{param}.content")
        return {**m, "content": "".join(text) if isinstance(text, list) else text}

    def schema(self):
        extra = {name: nullable(spec.doc()) for name, spec in self.fields.items()}
        content = self.content.doc()
        return {"anyOf": [
            {"type": "object", "required": ["role", "content"],
             "properties": {"role": {"type": "string", "enum": [r for r in ROLES if r != "assistant"]},
                            "content": content, **extra}},
            {"type": "object", "required": ["role"],
             "properties": {"role": {"const": "assistant"}, "content": nullable(content), **extra}},
        ]}


class Prompt(Spec):
    """A completion prompt: text, token ids, or a batch of one of these."""

    kinds = ("string", "array")

    def __init__(self, lim: Limits):
        super().__init__("The text to complete, its token ids, or a batch of exactly one of these.")
        self.text, self.ids = String(lim.max_chars), TokenIds(lim)

    def check(self, v, param):
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > 1:
                raise invalid(param, f"'{param}' holds {len(v)} prompts; send one per request", "unsupported_parameter")
            v = v[0]  # a batch of one
        if isinstance(v, str):
            return self.text.check(v, param)
        if isinstance(v, list):
            if not all(_json_kind(t) == "integer" for t in v):
                raise invalid(param, f"'{param}' must be a string, an array of token ids, or a batch of one of these",
                              "invalid_type")
            return self.ids.check(v, param)
        raise invalid(param, f"'{param}' must be a string or an array of token ids, not {_kind(v)}", "invalid_type")

    def schema(self):
        text, ids = self.text.doc(), self.ids.doc()
        return {"anyOf": [text, ids, {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
                          {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]}


# ---- structured output: response_format, grammar, tools ------------------------------------------
def tool_spec(lim: Limits) -> Obj:
    function = Obj({
        "name": String(MAX_FUNCTION_NAME, 1, description="Letters, digits, '_', '-' or '.'."),
        "description": String(lim.max_chars),
        "parameters": AnyJson("object", "The arguments' JSON schema; a call's arguments always follow it."),
        "strict": Boolean("Accepted: arguments always follow 'parameters'."),
    }, required=("name",))
    return Obj({"type": String(choices=("function",), refusal="only function tools are supported"),
                "function": function}, required=("type", "function"))


def structure_fields(lim: Limits) -> dict[str, Spec]:
    """The fields that constrain the answer (structured.py), shared by both generation models."""
    return {
        "response_format": Obj({
            "type": String(choices=("text", "json_object", "json_schema")),
            "json_schema": Obj({"name": String(MAX_FUNCTION_NAME), "description": String(lim.max_chars),
                                "schema": AnyJson("object", "The JSON schema the answer is valid against."),
                                "strict": Boolean("Accepted: the answer always follows the schema.")}),
        }, required=("type",), description="'json_object': the answer is a JSON object; 'json_schema': JSON valid "
                                            "against json_schema.schema (enforced token by token).",
            rules=[{"anyOf": [{"properties": {"type": {"enum": ["text", "json_object"]}}},
                              {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}],
                    "description": "'json_schema' with type 'json_schema'."}]),
        "grammar": String(lim.max_chars, 1, description="llama-server's extension: a GBNF or Lark grammar the answer "
                          "follows (not with response_format json or tools)."),
    }


def _structure(v: dict, tools: list | None = None, tool_choice=None, parallel: bool | None = None) -> Structure:
    fmt, grammar = v["response_format"], v["grammar"]
    if fmt is not None and fmt["type"] == "json_schema" and fmt["json_schema"] is None:
        raise invalid("response_format.json_schema", "'response_format.json_schema' is required with type 'json_schema'",
                      "missing_required_parameter")
    fmt = None if fmt is None or fmt["type"] == "text" else fmt
    if isinstance(tool_choice, dict):
        tool_choice = tool_choice["function"]["name"]
    if tools and tool_choice is None:
        tool_choice = "auto"  # OpenAI's default with tools
    if tool_choice not in (None, "none", "auto") and not tools:
        raise invalid("tool_choice", f"'tool_choice' {tool_choice!r} needs 'tools'")
    if grammar is not None and (fmt is not None or (tools and tool_choice != "none")):
        raise invalid("grammar", "'grammar' cannot be combined with a JSON 'response_format' or with tools")
    return Structure(fmt, grammar, tools or None, tool_choice or "none", True if parallel is None else parallel)


# ---- the request models ---------------------------------------------------------------------------
STREAM_RULE = {"anyOf": [{"properties": {"stream": {"const": True}}, "required": ["stream"]},
                         {"properties": {"stream_options": {"type": "null"}}}],
               "description": "'stream_options' only with 'stream': true."}


def sampling_fields(lim: Limits) -> dict[str, Spec]:
    cap = lim.tokens_cap
    return {
        "model": String(MAX_NAME, description="The model id (GET /v1/models); absent: the one model."),
        "max_tokens": Integer(1, cap, "Most tokens to generate; absent: up to the context (or the model's "
                              "generation_config max_new_tokens)."),
        "temperature": Number(0.0, 2.0, description="0: greedy (as are values below 1e-5); absent: "
                              "generation_config.json's, else 1."),
        "top_p": Number(0.0, 1.0, low_open=True, description="Nucleus sampling; absent: generation_config.json's, else 1."),
        "top_k": Integer(-1, (1 << 31) - 1, "vLLM's extension: the k most likely tokens; 0 or -1: no cut (as "
                         "is a k past the vocabulary)."),  # below 2**31, as engine.check_sampling bounds it
        "seed": Integer(-(1 << 63), (1 << 64) - 1, "Seed of the sampler: the same seed, the same answer; "
                        "-1 (or absent): random. A negative seed is taken modulo 2**64."),
        "stop": OneOfKinds(String(MAX_STOP_CHARS, 1),
                           Array(String(MAX_STOP_CHARS, 1), max_items=MAX_STOP),
                           description="Strings that end the answer; never part of it."),
        "stream": Boolean("Answer as server-sent events (text/event-stream), ending 'data: [DONE]'."),
        "stream_options": Obj({"include_usage": Boolean("A last chunk with 'usage'.")}),
        "ignore_eos": Boolean("vLLM's extension: keep generating past end-of-sequence tokens."),
        "n": Neutral(1, "one choice per request"),
        "presence_penalty": Number(-2.0, 2.0, description="Subtracted from the logit of every token the answer "
                                   "holds (OpenAI's)."),
        "frequency_penalty": Number(-2.0, 2.0, description="Subtracted from a token's logit once per time the "
                                    "answer holds it (OpenAI's)."),
        "repetition_penalty": Number(0.01, 100.0, description="vLLM's: a token of the prompt or the "
                                     "answer has its logit divided by it (if positive) or multiplied (if not); 1: "
                                     "none; absent: generation_config.json's, else 1."),
        "repeat_penalty": Number(0.01, 100.0, description="llama-server's name of "
                                 "'repetition_penalty'."),
        "repeat_last_n": Integer(-1, (1 << 31) - 1, "llama-server's: every penalty counts only the last N tokens "
                                 "of prompt and answer (-1: all of them; 0: no penalty)."),
        "min_p": Number(0.0, 1.0, description="Only tokens at least this fraction as likely as the most likely "
                        "one; absent: generation_config.json's, else 0."),
        "logit_bias": LogitBias(lim),
        "user": String(MAX_NAME, description="Accepted and ignored."),
        **llama_server_fields(),
    }


def llama_server_fields() -> dict[str, Spec]:
    """llama-server's knobs that colibri does not have, accepted at the neutral values its clients send,
    and the settings that only they read (which then change nothing, as in llama-server)."""
    def read_with(knob: str) -> Number:
        return Number(-1e9, 1e9, description=f"Accepted: read only with '{knob}', which colibri does not do.")

    return {
        "typical_p": Neutral(1, "no locally typical sampling"),
        "tfs_z": Neutral(1, "no tail-free sampling"),
        "top_n_sigma": Neutral(-1, "no top-n-sigma sampling"),
        "min_keep": Neutral(0, "every cut keeps at least the most likely token"),
        "mirostat": Neutral(0, "no mirostat"),
        "mirostat_tau": read_with("mirostat"), "mirostat_eta": read_with("mirostat"),
        "dynatemp_range": Neutral(0, "no dynamic temperature"),
        "dynatemp_exponent": read_with("dynatemp_range"),
        "dry_multiplier": Neutral(0, "no DRY sampling"),
        "dry_base": read_with("dry_multiplier"), "dry_allowed_length": read_with("dry_multiplier"),
        "dry_penalty_last_n": read_with("dry_multiplier"),
        "dry_sequence_breakers": Array(String(MAX_STOP_CHARS), max_items=MAX_STOP,
                                       description="Accepted: read only with 'dry_multiplier', which colibri does "
                                                   "not do."),
        "xtc_probability": Neutral(0, "no XTC sampling"),
        "xtc_threshold": read_with("xtc_probability"),
        "id_slot": Neutral(-1, "one slot: the server's queue"),
        "n_keep": Integer(-1, (1 << 31) - 1, "Accepted: colibri never shifts the context (a prompt and "
                          "max_tokens past it are a 400)."),
        "cache_prompt": Boolean("Accepted: the prefix cache serves a repeated prefix always, bit for bit as a "
                                "cold prefill would."),
    }


def chat_model(lim: Limits = Limits()) -> Obj:
    return Obj({
        **sampling_fields(lim),
        "messages": Array(Message(lim), 1, MAX_MESSAGES, "The conversation, rendered by the model's chat template."),
        "max_completion_tokens": Integer(1, lim.tokens_cap, "The newer name of 'max_tokens' (wins over it)."),
        **structure_fields(lim),
        "tools": Array(tool_spec(lim), max_items=MAX_TOOLS, description="Functions the model may call: passed to the "
                       "chat template (or described in a system message if it ignores them); calls come back as "
                       "'tool_calls'."),
        "tool_choice": OneOfKinds(
            String(choices=("none", "auto", "required")),
            Obj({"type": String(choices=("function",)), "function": Obj({"name": String(MAX_FUNCTION_NAME, 1)},
                                                                         required=("name",))},
                required=("type", "function")),
            description="'auto' (the default with tools): text or calls; 'required': calls; a named function: one "
                        "call of it; 'none': text."),
        "parallel_tool_calls": Boolean("More than one call in an answer (default true)."),
        "logprobs": Boolean("Each token's log-probability in choices[].logprobs.content: the model's own "
                            "distribution, before bias, penalties, temperature and cuts (vLLM's default)."),
        "top_logprobs": Integer(0, MAX_LOGPROBS, "With 'logprobs': the most likely tokens listed at each "
                                "position."),
        "store": Neutral(False, "no stored completions"),
        "metadata": AnyJson("object", "Accepted and ignored (it describes stored completions)."),
        "modalities": Array(String(choices=("text",), refusal="this model writes text only"), max_items=1,
                            description="Only [\"text\"]."),
        "service_tier": String(choices=("auto", "default"), refusal="one tier"),
        "prompt_cache_key": String(MAX_NAME, description="Accepted: the prefix cache finds a shared prefix by "
                                   "its tokens."),
        "safety_identifier": String(MAX_NAME, description="Accepted and ignored."),
    }, required=("messages",), rules=[STREAM_RULE], closed=True)


def completion_model(lim: Limits = Limits()) -> Obj:
    return Obj({
        **sampling_fields(lim),
        "prompt": Prompt(lim),
        "echo": Boolean("Put the prompt before the completion."),
        **structure_fields(lim),  # vLLM's and llama-server's extensions to completions
        "suffix": Neutral("", "no fill-in-the-middle"),
        "best_of": Neutral(1, "one choice per request"),
        "logprobs": Integer(0, MAX_LOGPROBS, "Each token's log-probability and this many most likely tokens' "
                            "(tokens, token_logprobs, top_logprobs, text_offset): the model's own distribution, "
                            "before bias, penalties, temperature and cuts (vLLM's default); not with 'echo'."),
    }, required=("prompt",), rules=[STREAM_RULE], closed=True)


def tokenize_model(lim: Limits = Limits()) -> Obj:
    text = String(lim.max_chars)
    return Obj({
        "model": String(MAX_NAME),
        "content": text,
        "prompt": String(lim.max_chars, description="The same as 'content' (vLLM's name)."),
        "messages": Array(Message(lim), 1, MAX_MESSAGES, "A conversation: rendered by the chat template, then tokenized."),
        "add_special_tokens": Boolean("Add the tokenizer's special tokens (BOS) to 'content' (default true)."),
        "add_special": Boolean("llama-server's name of 'add_special_tokens'."),
        "add_generation_prompt": Boolean("With 'messages': end with the assistant's turn opening (default true)."),
    }, rules=[{"anyOf": [{"required": ["content"], "properties": {"content": {"type": "string"}}},
                         {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                         {"required": ["messages"], "properties": {"messages": {"type": "array"}}}],
               "description": "One of 'content', 'prompt' or 'messages'."}])


def detokenize_model(lim: Limits = Limits()) -> Obj:
    return Obj({"model": String(MAX_NAME), "tokens": TokenIds(lim, min_items=0)}, required=("tokens",))


# ---- what the handlers get ----------------------------------------------------------------------------
@dataclass
class Sampling:
    """One generation request, as the worker runs it."""

    model: str | None  # the model id asked for (None: the one model)
    max_tokens: int | None  # None: up to the context length (or generation_config's max_new_tokens)
    temperature: float | None  # None: generation_config.json's default, else 1.0
    top_p: float | None
    top_k: int | None  # 0 = no top-k cut
    seed: int | None  # None: random
    stop: list[str] = field(default_factory=list)  # stop strings, never part of the output
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    ignore_eos: bool = False  # vLLM extension: keep generating past end-of-sequence tokens
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from, for errors that name it
    min_p: float | None = None  # None: generation_config.json's, else 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # None: generation_config.json's, else 1
    penalty_last_n: int | None = None  # llama-server's repeat_last_n (generate.Sampling); None: vLLM's rule
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # the most likely tokens listed with each token's log-probability; None: none


def _sampling(v: dict, max_tokens, max_tokens_param: str = "max_tokens", logprobs: int | None = None) -> Sampling:
    if v["stream_options"] is not None and not v["stream"]:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    stop = v["stop"]
    seed = v["seed"]
    repetition = v["repetition_penalty"]
    if v["repeat_penalty"] is not None:
        if repetition is not None and repetition != v["repeat_penalty"]:
            raise invalid("repeat_penalty", "'repeat_penalty' (llama-server's name) and 'repetition_penalty' differ: "
                          "send one")
        repetition = v["repeat_penalty"]
    last_n = v["repeat_last_n"]
    return Sampling(
        min_p=v["min_p"],
        presence_penalty=v["presence_penalty"] or 0.0,
        frequency_penalty=v["frequency_penalty"] or 0.0,
        repetition_penalty=repetition,
        penalty_last_n=None if last_n is None else (1 << 31) - 1 if last_n == -1 else last_n,  # -1: every token
        logit_bias=v["logit_bias"] or {},
        logprobs=logprobs,
        model=v["model"],
        max_tokens=max_tokens,
        temperature=v["temperature"],
        top_p=v["top_p"],
        top_k=None if v["top_k"] is None else max(v["top_k"], 0),  # vLLM's -1 means "no cut", as 0 does here
        seed=None if seed is None or seed == -1 else seed % (1 << 64),  # -1: random, as llama-server means it
        stop=[stop] if isinstance(stop, str) else stop or [],
        stream=bool(v["stream"]),
        include_usage=bool(v["stream_options"] and v["stream_options"]["include_usage"]),
        ignore_eos=bool(v["ignore_eos"]),
        max_tokens_param=max_tokens_param,
    )


def parse_sampling(body: dict, lim: Limits = Limits()) -> Sampling:
    v = Obj(sampling_fields(lim)).check(body, "")
    return _sampling(v, v["max_tokens"])


@dataclass
class Structure:
    """What the answer must be (structured.py); all None / "none": free text."""

    response_format: dict | None = None  # {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}
    grammar: str | None = None  # GBNF or Lark
    tools: list | None = None  # OpenAI's tools, checked by the model's spec (structured.tool_functions checks more)
    tool_choice: str = "none"  # "none" | "auto" | "required" | a function's name
    parallel_tool_calls: bool = True

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass
class ChatRequest:
    sampling: Sampling
    messages: list[dict]  # role + content (a string) + whatever else the template may read
    tools: list | None
    structure: Structure = field(default_factory=Structure)


def parse_chat(body: dict, lim: Limits = Limits()) -> ChatRequest:
    v = chat_model(lim).check(body, "")
    param = "max_completion_tokens" if v["max_completion_tokens"] is not None else "max_tokens"
    tools = body["tools"] if v["tools"] else None  # as sent (checked): the template sees every field it was given
    structure = _structure(v, tools, v["tool_choice"], v["parallel_tool_calls"])
    if v["top_logprobs"] is not None and not v["logprobs"]:
        raise invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    logprobs = (v["top_logprobs"] or 0) if v["logprobs"] else None
    return ChatRequest(_sampling(v, v[param], param, logprobs), v["messages"], tools, structure)


@dataclass
class CompletionRequest:
    sampling: Sampling
    prompt: str | list[int]  # text, or token ids
    echo: bool  # put the prompt before the completion
    structure: Structure = field(default_factory=Structure)


def parse_completion(body: dict, lim: Limits = Limits()) -> CompletionRequest:
    v = completion_model(lim).check(body, "")
    if v["logprobs"] is not None and v["echo"]:
        raise invalid("logprobs", "'logprobs' with 'echo' (the prompt's log-probabilities) is not supported by "
                      "colibri", "unsupported_parameter")
    return CompletionRequest(_sampling(v, v["max_tokens"], logprobs=v["logprobs"]), v["prompt"], bool(v["echo"]),
                             _structure(v))
